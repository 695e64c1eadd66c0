"""The replica's own open deadline (issue 56): with its prefill rate measured, an open that its
prefill queue would keep past the open's deadline is refused at once (429, Retry-After), while
opens that fit are prefilled; an open without a deadline is never refused for it."""

from __future__ import annotations

import asyncio
import time

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
    assert first[0] == 200 and core.open_forecast.rate
    refused = [(d, took) for status, d, took in burst if status == 429]
    admitted = [took for status, d, took in burst if status == 200]
    assert refused and admitted, (len(refused), len(admitted))  # past capacity, and the first still fit
    assert all(d["error"]["reason"] == "open_deadline" and d["error"]["retry_after"] > 0 for d, _ in refused)
    assert max(took for _, took in refused) < min(admitted) + 0.05  # refused at the door, not after waiting
    assert all(status == 200 for status, _, _ in unbounded)
    assert core.open_forecast.queued_tokens == 0  # every open left the queue
