"""Server-side truncation through the replica (issue 15): with a steep measured cost curve
the replica verifies only a prefix of each priority-ordered tree, says how many nodes in the
reply, and the output is still exactly the target's greedy decoding. Sampled trees (tree
rejection sampling, issue 17) are never cut."""

from __future__ import annotations

import asyncio
import math
import random

import torch

from deploy.config import AppConfig
from specdec.protocol import ReplyFrame, VerifyFrame
from specdec.proposal import Proposal, draw_without_replacement
from deploy.verifier.server import VerifierServer
from specdec.model.loading import load_target
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from specdec.truncation import encode_confidence

VOCAB = 512


def test_truncated_rounds_are_exact_and_report_what_was_verified():
    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"batch_wait_ms": 5}))
    for rows in (8, 16, 32, 64, 128, 256):  # a steep CPU-like curve: every row above 8 costs 2 ms
        core.pacer.observe_forward(rows, 0.01 + 0.002 * max(0, rows - 8))
    core.pacer.cost.refit()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(10)] for _ in range(6)]
    target = load_target(core.cfg.target).model
    refs = [reference_decode(target, p, SamplingParams(max_tokens=12)) for p in prompts]

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


def _sampled_tree(rng: random.Random, g: torch.Generator) -> tuple[list[int], list[int], list]:
    """A 24-node tree as the edge's tree rejection sampling sends it (F_TREEQ): 16 root children
    drawn without replacement from a 16-entry proposal, a chain of 8 below the first, one
    proposal per position (root, then node i; leaves carry none)."""
    ids = rng.sample(range(3, VOCAB), 16)
    weights = [rng.randrange(1, 65536) for _ in ids]
    kids = draw_without_replacement(Proposal(tuple(ids), tuple(weights)), 16, g)
    tokens, parents, props = list(kids), [-1] * 16, [(tuple(ids), tuple(weights))] + [None] * 16
    parent = 0
    for _ in range(8):
        sub = rng.sample(range(3, VOCAB), 4)
        props[parent + 1] = (tuple(sub), (40000, 20000, 5000, 1000))
        tokens.append(sub[rng.randrange(4)])
        parents.append(parent)
        props.append(None)
        parent = len(tokens) - 1
    return tokens, parents, props


def test_sampled_trees_are_never_truncated_while_plain_trees_are():
    """Tree rejection sampling is exact only on the whole tree its siblings were drawn for
    (a cut by value would bias it): with the steep cost curve cutting the plain greedy trees of
    the same batches, every sampled (F_TREEQ) tree is verified whole, with the same confidence
    bytes the plain trees carry."""
    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"batch_wait_ms": 5}))
    for rows in (8, 16, 32, 64, 128, 256):
        core.pacer.observe_forward(rows, 0.01 + 0.002 * max(0, rows - 8))
    core.pacer.cost.refit()
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    conf = [200] * 16 + [encode_confidence(math.log(0.9) * (i + 1)) for i in range(8)]

    async def session(seed: int, sampled: bool):
        sampling = {"max_tokens": 10, "ignore_eos": True}
        if sampled:
            sampling.update(temperature=1.0, seed=seed)
        prompt = [rng.randrange(3, VOCAB) for _ in range(10)]
        _, d = await core.open_session("dev", {"prompt_ids": prompt, "sampling": sampling})
        n, verified, out = d["prefix_len"], [], [d["first_token"]]
        while True:
            if sampled:
                tokens, parents, props = _sampled_tree(rng, g)
            else:  # a plain tree of the same shape, no proposals: truncation may cut it
                tokens, parents, props = [rng.randrange(3, VOCAB) for _ in range(24)], [-1] * 16 + [0] + list(
                    range(16, 23)), None
            frame = VerifyFrame(n, tokens, parents, conf=conf, proposals=props).encode()
            status, reply = await core.verify(d["session_id"], "dev", frame)
            assert status == 200, reply
            r = ReplyFrame.decode(reply)
            verified.append(len(tokens) if r.verified is None else r.verified)
            path = [tokens[a] for a in r.accepted]
            assert all(parents[b] == a for a, b in zip([-1] + list(r.accepted), r.accepted))  # a root path
            out += path + ([r.bonus] if r.bonus is not None else [])
            n = r.prefix_len
            if r.finished:
                break
        await core.close_session(d["session_id"], "dev")
        return sampled, verified, out

    async def main():
        jobs = [session(s, sampled=s % 2 == 0) for s in range(6)]
        return await asyncio.wait_for(asyncio.gather(*jobs), 120)

    results = asyncio.run(main())
    for sampled, verified, out in results:
        assert len(out) == 10
        if sampled:
            assert verified == [24] * len(verified)  # never cut
    assert min(v for sampled, vs, _ in results if not sampled for v in vs) < 24  # the curve did cut plain trees
