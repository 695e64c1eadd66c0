"""The replica's batch loop under hostile clients and races (issue 14), in process: a dropped
request, a bad value or a failing reply never touches another request; a close racing a
forward leaks nothing; one tenant's flood evicts its own sessions, not the others'."""

from __future__ import annotations

import asyncio
import random

import pytest

from deploy.config import AppConfig
from specdec.protocol import ReplyFrame, VerifyFrame
from deploy.verifier.server import VerifierServer
from specdec.model.loading import load_target
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams

TENANTS = [{"name": "alpha", "api_key": "alpha-key-123"}, {"name": "beta", "api_key": "beta-key-1234"}]
VOCAB = 512


def make_core(pacing: dict | None = None, **verifier) -> VerifierServer:
    return VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"}, pacing=pacing or {},
                                  verifier={"batch_wait_ms": 3, **verifier}, router={"tenants": TENANTS}))


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


async def open_session(core, tenant, p, max_tokens=16, **client):
    status, d = await core.open_session(tenant, {"prompt_ids": p, "sampling": {"max_tokens": max_tokens},
                                                 "client": client})
    assert status == 200, d
    return d


async def generate(core, tenant, p, max_tokens=16) -> list[int]:
    """Plain decoding through verify rounds (empty trees): must equal the target's greedy output."""
    d = await open_session(core, tenant, p, max_tokens)
    sid, n, out, done = d["session_id"], d["prefix_len"], [d["first_token"]], d["finished"]
    while not done:
        status, reply = await asyncio.wait_for(core.verify(sid, tenant, VerifyFrame(n, [], []).encode()), 30)
        assert status == 200, reply
        r = ReplyFrame.decode(reply)
        out.append(r.bonus)
        n, done = r.prefix_len, r.finished
    await core.close_session(sid, tenant)
    return out


def reference(core, p, max_tokens=16):
    return reference_decode(load_target(core.cfg.target).model, p, SamplingParams(max_tokens=max_tokens))


def test_dropped_requests_mid_batch_never_hold_up_another_tenants_rounds():
    """Issue 14 #1: a cancelled request (its client dropped the connection) in a batch made
    every later answer of that batch raise, and the other tenant's requests hung."""
    core = make_core()

    async def dropper(i):
        d = await open_session(core, "alpha", prompt(100 + i), max_tokens=64)
        rng = random.Random(i)
        for _ in range(12):
            task = asyncio.ensure_future(core.verify(d["session_id"], "alpha",
                                                     VerifyFrame(d["prefix_len"], [], []).encode()))
            await asyncio.sleep(rng.uniform(0, 0.006))  # before, during or after the forward
            task.cancel()
            try:
                status, reply = await task
            except asyncio.CancelledError:
                continue
            if status == 200:
                d["prefix_len"] = ReplyFrame.decode(reply).prefix_len

    async def main():
        bystanders = [generate(core, "beta", prompt(i)) for i in range(4)]
        results = await asyncio.wait_for(asyncio.gather(*bystanders, *(dropper(i) for i in range(4))), 120)
        return results[:4]

    outs = asyncio.run(main())
    assert outs == [reference(core, prompt(i)) for i in range(4)]


def test_a_denormal_draft_ms_on_open_does_not_hang_its_batch():
    """Issue 14 #2: draft_ms = 5e-324 made the depth hint int(round(inf)): that open and the
    requests sharing its batch were never answered. Trees only (no "no tree" budget, which has no
    depth) and a second session held open, so the hint takes the paced path that divides by
    draft_ms, whatever the pacer would choose on this machine."""
    core = make_core(pacing={"tree_budgets": [8]})

    async def main():
        await generate(core, "beta", prompt(1), max_tokens=8)  # the pacer's cost model has data now
        held = await open_session(core, "beta", prompt(4))
        odd = open_session(core, "alpha", prompt(2), draft_ms=5e-324, rtt_ms=5e-324)
        opened, out = await asyncio.wait_for(asyncio.gather(odd, generate(core, "beta", prompt(3))), 60)
        await core.close_session(held["session_id"], "beta")
        return opened, out

    opened, out = asyncio.run(main())
    assert opened["budget_hint"] == 8 and 1 <= opened["depth_hint"] <= 12
    assert out == reference(core, prompt(3))


def test_a_reply_that_fails_answers_only_its_own_request():
    core = make_core()
    on_round = core.metrics.on_round
    victim = {}

    def flaky(tenant, sid, *args, **kwargs):
        if sid == victim.get("sid"):
            raise RuntimeError("metrics backend down")
        return on_round(tenant, sid, *args, **kwargs)

    core.metrics.on_round = flaky

    async def main():
        d = await open_session(core, "alpha", prompt(7))
        victim["sid"] = d["session_id"]
        bad = core.verify(d["session_id"], "alpha", VerifyFrame(d["prefix_len"], [], []).encode())
        return await asyncio.wait_for(asyncio.gather(bad, generate(core, "beta", prompt(8))), 60)

    (status, payload), out = asyncio.run(main())
    assert status == 500 and payload["error"]["code"] == "internal"
    assert out == reference(core, prompt(8))


def test_closes_racing_verify_forwards_leave_no_kv():
    """Issue 14 #3: a DELETE while the session's verify forward ran re-created its KV."""
    core = make_core()
    rng = random.Random(0)

    async def race(i):
        d = await open_session(core, "alpha" if i % 2 else "beta", prompt(200 + i))
        tenant = "alpha" if i % 2 else "beta"
        frame = VerifyFrame(d["prefix_len"], [5, 6, 7], [-1, 0, 1]).encode()
        verify = asyncio.ensure_future(core.verify(d["session_id"], tenant, frame))
        await asyncio.sleep(rng.uniform(0, 0.008))
        closed = await core.close_session(d["session_id"], tenant)
        status, _ = await verify
        assert closed[0] == 200 and status in (200, 404)

    async def main():
        for wave in range(5):
            await asyncio.wait_for(asyncio.gather(*(race(10 * wave + i) for i in range(10))), 60)

    asyncio.run(main())
    assert not core.engine.sessions and not core.owner and not core.sessions.client
    assert core.engine.kv_tokens() == 0 and core.engine.kv_used_tokens() == 0


@pytest.mark.parametrize("quota", [None, 64])
def test_one_tenants_flood_evicts_its_own_sessions_not_the_others(quota):
    """Per-tenant KV: with a quota, alpha's LRU sessions go above it; without one, alpha is
    over its fair share of the replica's budget, so it loses sessions before beta does."""
    tenants = [{**TENANTS[0], "kv_quota_tokens": quota}, TENANTS[1]]
    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"batch_wait_ms": 0, "kv_budget_tokens": 256},
                                  router={"tenants": tenants}))

    async def main():
        beta = [await open_session(core, "beta", prompt(i)) for i in range(3)]  # 3 x 16 tokens
        for i in range(14):  # alpha floods: 14 x 16 tokens would take the budget past 256
            await open_session(core, "alpha", prompt(50 + i))
        return beta

    beta = asyncio.run(main())
    assert all(core.owner.get(d["session_id"]) == "beta" for d in beta)  # none of beta's was evicted
    alpha_kv = sum(16 for sid, t in core.owner.items() if t == "alpha")
    assert core.engine.kv_used_tokens() <= 256 and alpha_kv <= (quota or 256)
    assert len(core.sessions.evicted) >= (14 - 64 // 16 if quota else 1)
