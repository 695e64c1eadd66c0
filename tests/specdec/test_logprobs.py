"""Log-probs of emitted tokens: the target's float32 log-softmax at each emitted position, through
trees, batches and the open's first token; on the wire in R_LOGPROBS."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import InvalidRequest
from specdec.protocol import ReplyFrame, TokenLogprob
from specdec.engine import ChainVerifyRequest, OpenRequest, VerifierEngine, VerifyRequest
from specdec.sampling import SamplingParams
from tests.specdec.test_engine import EOS, random_prompt, random_tree


def reference_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out), vocab]: float32 log-softmax of the target at each emitted position (one plain forward)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out])).logits[0].float()  # [L, vocab]
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(out) - 1], -1)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=25, logprobs=3),
                                    SamplingParams(temperature=0.9, seed=5, max_tokens=25, logprobs=0),
                                    SamplingParams(max_tokens=25, logprobs=5, presence_penalty=1.0)],
                         ids=["greedy-top3", "sampled", "penalised"])
def test_logprobs_are_the_targets_log_softmax_at_each_emitted_position(tiny_model, params):
    rng = random.Random(1)
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    prompts = {f"l{i}": random_prompt(rng, 512, 2, 30) for i in range(3)}
    got: dict[str, list[TokenLogprob]] = {}
    for sid, r in zip(prompts, eng.open([OpenRequest(sid, p, params) for sid, p in prompts.items()])):
        got[sid] = [r.first_logprob]
    while live := [sid for sid in prompts if not eng.sessions[sid].finished]:
        reqs = [VerifyRequest(sid, random_tree(rng, [], 512, 16, 4), len(eng.sessions[sid].prefix)) for sid in live]
        for sid, res in zip(live, eng.verify(reqs)):
            assert len(res.logprobs) == len(res.tokens)
            got[sid] += res.logprobs
    for sid, prompt in prompts.items():
        out = eng.sessions[sid].prefix[len(prompt):]
        assert [lp.token for lp in got[sid]] == out
        ref = reference_logprobs(tiny_model, prompt, out)
        assert torch.allclose(torch.tensor([lp.logprob for lp in got[sid]]), ref[range(len(out)), out], atol=1e-4)
        for lp, row in zip(got[sid], ref):
            assert len(lp.top_ids) == params.logprobs
            if params.logprobs:
                vals, ids = torch.topk(row, params.logprobs)
                assert torch.allclose(torch.tensor(lp.top_logprobs), vals, atol=1e-4)
                assert set(lp.top_ids) == set(ids.tolist()) or torch.allclose(row[list(lp.top_ids)], vals, atol=1e-4)


def test_sessions_without_logprobs_get_none_and_chain_mode_refuses_them(tiny_model):
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    a, b = eng.open([OpenRequest("a", [5, 6, 7], SamplingParams(max_tokens=8)),
                     OpenRequest("b", [5, 6, 7], SamplingParams(max_tokens=8, logprobs=2))])
    assert a.first_logprob is None and b.first_logprob is not None
    (res,) = eng.verify([VerifyRequest("a", random_tree(random.Random(0), [], 512, 4, 2), 4)])
    assert res.logprobs is None
    (err,) = eng.verify_chain([ChainVerifyRequest("b", (9,), (0.5,), 4)])
    assert isinstance(err, InvalidRequest) and "chain" in err.message


def test_logprobs_round_trip_on_the_wire():
    lps = [TokenLogprob(-1, -0.25, (4, 9), (-0.25, -2.5)), TokenLogprob(-1, -1.5, (7, 1), (-0.5, -1.5)),
           TokenLogprob(11, -3.0, (2, 3), (-0.125, -2.0))]
    frame = ReplyFrame([1, 0], 11, 40, logprobs=lps)
    back = ReplyFrame.decode(frame.encode())
    assert back.logprobs == lps and back.accepted == [1, 0] and back.bonus == 11
    assert [lp.token for lp in back.token_logprobs([5, 8])] == [8, 5, 11]
    assert ReplyFrame.decode(ReplyFrame([0], 3, 2).encode()).logprobs is None
    data = frame.encode()
    for bad in (data[:-1], data + b"\0", data[:-4 * 2 * 3]):
        with pytest.raises(InvalidRequest):
            ReplyFrame.decode(bad)
