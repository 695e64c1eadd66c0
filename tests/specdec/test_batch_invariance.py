"""Batch invariance in bf16 (issue: the product's guarantee where it is used).

Greedy output through the engine, with random trees, random prefill chunking and 1..16
random other sessions in every batch (random prefix lengths, AR and tree sessions mixed),
equals one-token-at-a-time bf16 decoding by the same engine, token for token: prefill one
token per forward, then one empty tree per round, the session alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest, VerifyResult
from specdec.model.loading import tiny_random_model
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeLimits
from tests.specdec.test_engine import random_prompt, random_tree
from tests.specdec.test_engine_embedded import chat_prompt

LIMITS = TreeLimits(max_nodes=64, max_depth=16)


def one_token_decode(model, eos, prompt: list[int], params: SamplingParams, compile: bool = False) -> list[int]:
    """The reference: the session alone, one token per forward (prefill included)."""
    eng = VerifierEngine(model, eos_token_ids=eos, limits=LIMITS, compile=compile)
    assert eng.begin_open([OpenRequest("ref", prompt, params)]) == [None]
    while eng.prefilling:
        opened = eng.prefill_step(1)
    out = [opened[0].first_token]
    s = eng.sessions["ref"]
    while not s.finished:
        (res,) = eng.verify([VerifyRequest("ref", DraftTree.empty(), len(s.prefix))])
        out += list(res.tokens)
    return out


def batched_decode(model, eos, prompts: dict[str, list[int]], params: SamplingParams, truths: dict[str, list[int]],
                   rng: random.Random, max_others: int = 16, other_len: tuple[int, int] = (1, 200),
                   compile: bool = False) -> dict:
    """The sessions of ``prompts`` verified with random trees among 1..max_others other
    sessions per batch; prefill chunked at random with the others' prompts."""
    V = model.config.vocab_size
    eng = VerifierEngine(model, eos_token_ids=eos, limits=LIMITS, compile=compile)
    n_other = rng.randint(1, max_others)
    others = {f"o{i}": random_prompt(rng, V, *other_len) for i in range(n_other)}
    ar = {sid for sid in others if rng.random() < 0.5}  # plain decoding sessions
    reqs = [OpenRequest(sid, p, params) for sid, p in prompts.items()]
    reqs += [OpenRequest(sid, p, SamplingParams(max_tokens=1 << 12, ignore_eos=True)) for sid, p in others.items()]
    rng.shuffle(reqs)
    assert all(e is None for e in eng.begin_open(reqs))
    out: dict[str, list[int]] = {}
    while eng.prefilling:
        for res in eng.prefill_step(rng.randint(1, 96)):
            out[res.sid] = [res.first_token]
    while any(not eng.sessions[sid].finished for sid in prompts):
        live = [sid for sid in prompts if not eng.sessions[sid].finished]
        batch = rng.sample(live, rng.randint(1, len(live))) + rng.sample(sorted(others), rng.randint(1, n_other))
        rng.shuffle(batch)
        vreqs = []
        for sid in batch:
            s = eng.sessions[sid]
            if sid in ar:
                tree = DraftTree.empty()
            else:
                truth = truths[sid][s.num_generated:] if sid in truths else []
                tree = random_tree(rng, truth, V, max_size=48, max_depth=10)
            vreqs.append(VerifyRequest(sid, tree, len(s.prefix)))
        for req, res in zip(vreqs, eng.verify(vreqs)):
            assert isinstance(res, VerifyResult), res
            if req.sid in prompts:
                out[req.sid] += list(res.tokens)
    return {sid: out[sid] for sid in prompts}


def assert_batch_invariant(model, seed: int, params: SamplingParams) -> None:
    """Three random prompts' output among random other sessions, trees and prefill chunks
    (:func:`batched_decode`) equals one-token decoding's, token for token."""
    rng = random.Random(seed)
    prompts = {f"p{i}": random_prompt(rng, model.config.vocab_size, 1, 120) for i in range(3)}
    truths = {sid: one_token_decode(model, (), p, params) for sid, p in prompts.items()}
    assert batched_decode(model, (), prompts, params, truths, rng) == truths


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cfg", [dict(), dict(num_heads=6, num_kv_heads=2, hidden_size=96)])
def test_bf16_greedy_output_is_batch_invariant_on_tiny_models(seed, cfg):
    assert_batch_invariant(tiny_random_model(seed=seed, dtype=torch.bfloat16, **cfg), seed,
                           SamplingParams(max_tokens=40, ignore_eos=True))


SAMPLED = dict(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("seed", range(2))
def test_bf16_seeded_sampled_output_is_batch_invariant(seed):
    """Seeded sampling with the match rule draws one uniform per emitted token from the target's
    own distribution at that position, so with rows invariant the draws, hence the tokens, are
    those of one-token decoding whatever the batch, trees or chunking."""
    assert_batch_invariant(tiny_random_model(seed=seed, dtype=torch.bfloat16), seed,
                           SamplingParams(seed=seed + 7, **SAMPLED))


def test_batch_invariance_holds_with_the_compiled_forward():
    """verifier.compile: the torch.compile'd glue (one graph for a single row, one dynamic graph
    for the rest) keeps every row independent of its batch."""
    model = tiny_random_model(seed=5, dtype=torch.bfloat16)
    rng = random.Random(5)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = {f"p{i}": random_prompt(rng, 512, 1, 80) for i in range(2)}
    truths = {sid: one_token_decode(model, (), p, params, compile=True) for sid, p in prompts.items()}
    assert batched_decode(model, (), prompts, params, truths, rng, max_others=8, compile=True) == truths


@pytest.mark.slow
def test_bf16_greedy_output_is_batch_invariant_on_the_embedded_model():
    from specdec.model.loading import load_model

    lm = load_model("embedded", dtype="bfloat16", device="cpu")
    rng = random.Random(0)
    texts = ["Explain why the sky is blue in two sentences.", "Write a haiku about autumn rain.",
             "List three uses of a paperclip."]
    prompts = {f"p{i}": chat_prompt(lm.tokenizer, t) for i, t in enumerate(texts)}
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    truths = {sid: one_token_decode(lm.model, lm.eos_token_ids, p, params) for sid, p in prompts.items()}
    got = batched_decode(lm.model, lm.eos_token_ids, prompts, params, truths, rng, max_others=8, other_len=(5, 160))
    assert got == truths
