"""Server-side truncation through the replica (issue 15): with a steep measured cost curve
the replica verifies only a prefix of each priority-ordered tree, says how many nodes in the
reply, and the output is still exactly the target's greedy decoding."""

from __future__ import annotations

import asyncio
import math
import random

from deploy.config import AppConfig
from deploy.protocol import ReplyFrame, VerifyFrame
from deploy.verifier.deployment import VerifierCore
from deploy.verifier.reference import reference_decode
from deploy.verifier.sampling import SamplingParams
from deploy.verifier.truncation import encode_confidence

VOCAB = 512


def test_truncated_rounds_are_exact_and_report_what_was_verified():
    core = VerifierCore(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"batch_wait_ms": 5}))
    for rows in (8, 16, 32, 64, 128, 256):  # a steep CPU-like curve: every row above 8 costs 2 ms
        core.pacer.observe_forward(rows, 0.01 + 0.002 * max(0, rows - 8))
    core.pacer.cost.refit()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(10)] for _ in range(6)]
    refs = [reference_decode(core.loaded.model, p, SamplingParams(max_tokens=12)) for p in prompts]

    async def session(p, ref):
        _, d = await core.open_session("dev", {"prompt_ids": p, "sampling": {"max_tokens": 12}})
        out, n, verified = [d["first_token"]], d["prefix_len"], []
        while len(out) < len(ref):
            truth = ref[len(out):]
            # a priority-ordered 24-node tree: the true chain (confident) first, then noise
            tokens = truth[:8] + [rng.randrange(VOCAB) for _ in range(16)]
            parents = list(range(-1, min(8, len(truth)) - 1)) + [-1] * 16
            tokens = tokens[: len(parents)]
            conf = [encode_confidence(math.log(0.9) * (i + 1)) for i in range(len(truth[:8]))] + [200] * 16
            frame = VerifyFrame(n, tokens, parents, conf=conf[: len(tokens)]).encode()
            status, reply = await core.verify(d["session_id"], "dev", frame)
            assert status == 200, reply
            r = ReplyFrame.decode(reply)
            verified.append(len(tokens) if r.verified is None else r.verified)
            assert all(a < verified[-1] for a in r.accepted)
            out += [tokens[a] for a in r.accepted] + [r.bonus]
            n = r.prefix_len
            if r.finished:
                break
        await core.close_session(d["session_id"], "dev")
        return out, verified

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(session(p, r) for p, r in zip(prompts, refs))), 120)

    results = asyncio.run(main())
    for (out, verified), ref in zip(results, refs):
        assert out == ref
    all_verified = [v for _, vs in results for v in vs]
    assert min(all_verified) < 24  # the steep curve made the replica cut the noise
