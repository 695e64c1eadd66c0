"""The replica's own open deadline (issue 56): with its prefill rate measured, an open that its
prefill queue would keep past the open's deadline is refused at once (429, Retry-After), while
opens that fit are prefilled; an open without a deadline is never refused for it."""

from __future__ import annotations

import asyncio
import time

from deploy.verifier.startup import warm_up
from tests.verifier.test_replica_races import make_core, prompt


def test_a_replica_refuses_at_once_the_opens_its_queue_cannot_serve_in_time():
    core = make_core()

    async def open_one(seed: int, deadline_s: float | None):
        t0 = time.perf_counter()
        status, d = await core.open_session("alpha", {"prompt_ids": prompt(seed, 400), "sampling": {"max_tokens": 1},
                                                      "close_on_finish": True}, deadline_s)
        return status, d, time.perf_counter() - t0

    async def main():
        first = await open_one(0, 5.0)  # measures the rate
        burst = await asyncio.gather(*[open_one(1 + i, 0.05) for i in range(40)])
        unbounded = await asyncio.gather(*[open_one(100 + i, None) for i in range(4)])
        return first, burst, unbounded

    first, burst, unbounded = asyncio.run(main())
    assert first[0] == 200 and core.opens.forecast.cost.known
    refused = [(d, took) for status, d, took in burst if status == 429]
    admitted = [took for status, d, took in burst if status == 200]
    assert refused and admitted, (len(refused), len(admitted))  # past capacity, and the first still fit
    assert all(d["error"]["reason"] == "open_deadline" and d["error"]["retry_after"] > 0 for d, _ in refused)
    assert max(took for _, took in refused) < min(admitted) + 0.05  # refused at the door, not after waiting
    assert all(status == 200 for status, _, _ in unbounded)
    assert core.opens.forecast.queued_tokens == 0 and not core.opens.deadlines  # every open left the queue


def test_the_deadline_bounds_waiting_not_work():
    """Issue 67: an open first in line is prefilled whatever its deadline, its own prefill longer
    than that included; an open still waiting behind another's prefill at its deadline is dropped
    (429 ``open_deadline_passed``) before any of its tokens is computed."""
    core = make_core(max_batch_tokens=128, prefill_chunk_tokens=128)

    async def open_one(seed: int, n: int, deadline_s: float | None):
        return await core.open_session("alpha", {"prompt_ids": prompt(seed, n), "sampling": {"max_tokens": 1},
                                                 "close_on_finish": True}, deadline_s)

    async def main():
        # nothing measured yet: the door admits both, and the second waits behind the first's 12 forwards
        head, behind = await asyncio.gather(open_one(1, 1500, 0.001), open_one(2, 200, 0.001))
        alone = await open_one(0, 1500, 0.001)  # measured now, but none queued ahead: admitted
        return alone, head, behind

    alone, head, behind = asyncio.run(main())
    assert alone[0] == 200 and head[0] == 200, (alone, head)
    assert behind[0] == 429 and behind[1]["error"]["reason"] == "open_deadline_passed", behind
    assert "did not start" in behind[1]["error"]["message"] and behind[1]["error"]["retry_after"] > 0
    assert not core.engine.prefilling and not core.opens.deadlines and not core.opens.prefilling
    assert core.counters.prefill_tokens == 3000  # the dropped open's 200 tokens were never computed


def test_warm_up_runs_a_prefill_and_a_verify_and_leaves_nothing_behind():
    core = make_core(warmup=False, prefix_caching=True)
    seen = []
    core.engine.on_forward = seen.append
    warm_up(core.engine, core.loaded.vocab_size)
    assert [st.kind for st in seen] == ["prefill", "verify"]
    assert not core.engine.sessions and not core.engine.prefilling and core.engine.kv_used_tokens() == 0
    assert core.engine.prefix_cache_stats()["query_tokens"] == 0  # no dummy prompt offered or counted


def test_a_warmed_replica_has_measured_nothing_yet():
    """The warm-up's forwards (the cold first one among them) never reach the replica's cost models."""
    core = make_core()
    assert core.counters.to_dict()["forwards"] == 0 and core.pacer.cost.count == 0
    assert core.prefill.token_s == 0.0 and core.prefill.verify_s == 0.0 and not core.opens.forecast.cost.known
