"""The committed exit heads on the real embedded SmolLM2-135M-Instruct (fp32, slow).

The artifact is small, loads for this target, and its exits guess the target's next token
far above chance (held-out agreement 0.29-0.42; lower on this one prompt); with early results on, greedy verification still equals
target-only decoding token for token.
"""

from __future__ import annotations

import json
import random

import pytest

from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
from specdec.exit_heads import ALIASES, ExitHeads
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from tests.specdec.test_engine import random_tree
from tests.specdec.test_engine_embedded import chat_prompt, one_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.slow


def test_the_artifact_is_small_and_describes_itself():
    p = ALIASES["embedded"]
    meta = json.loads(p.with_suffix(".json").read_text())
    assert p.stat().st_size < 2 << 20
    assert meta["trained"] and meta["layers"] == [8, 12, 16, 20] and meta["vocab_subset"] == 4096
    assert all(meta["per_layer"][str(x)]["heldout_agreement"] > meta["per_layer"][str(x)]["logit_lens_agreement"]
               for x in meta["layers"])


def test_greedy_with_the_trained_exits_equals_reference_and_the_exits_guess(embedded):
    model, tok = embedded.model, embedded.tokenizer
    params = SamplingParams(max_tokens=24)
    prompt = chat_prompt(tok, "Explain why the sky is blue in two sentences.")
    ref = reference_decode(model, prompt, params, embedded.eos_token_ids)
    eng = VerifierEngine(model, eos_token_ids=embedded.eos_token_ids)
    eng.exit_heads = ExitHeads.load("embedded", model, (12, 20))
    (r,) = eng.open([OpenRequest("a", prompt, params)])
    out, early, rng = [r.first_token], [], random.Random(0)
    right = rounds = 0
    while not eng.sessions["a"].finished:
        s = eng.sessions["a"]
        tree = random_tree(rng, ref[s.num_generated:], eng.vocab_size, 16, 6, allow_empty=False)
        got = []
        (res,) = eng.verify([VerifyRequest("a", tree, len(s.prefix), early=True)], on_early=got.extend)
        out += list(res.tokens)
        rounds += 1
        first = [tree.tokens[g.accepted[0]] if g.accepted else g.token for g in got if g.layer == 20]
        right += first == [res.tokens[0]]  # exit 20's first token of the round is the target's
        early += got
    assert out == ref
    assert {g.layer for g in early} == {12, 20} and len(early) == 2 * rounds
    assert right >= 1, (right, rounds)  # chance: ~1/4096 per round
