"""Router.open under a verifier that cannot prefill in time: 429 at the deadline with the
verifier's call cancelled, then 429 at the door once the measured rate predicts it."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec.errors import InvalidRequest, Overloaded
from deploy.router.ingress import Router


class SlowPrefill:
    """A verifier handle whose open_session takes ``seconds``; records cancellations."""

    def __init__(self, seconds: float):
        self.seconds, self.cancelled, self.calls = seconds, 0, 0
        self.open_session = self

    def remote(self, **kwargs):
        return self._open()

    async def _open(self):
        self.calls += 1
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return 200, {"session_id": f"s.{self.calls}", "first_token": 1, "prefix_len": 1}


def _router(verifier, deadline_s: float):
    """The Router class under Serve's ingress wrapper (whose constructor is Serve's to await)."""
    cls = next(c for c in Router.func_or_class.__mro__[1:] if c.__name__ == "Router")
    r = cls.__new__(cls)
    cls.__init__(r, verifier, {"router": {"open_deadline_s": deadline_s}})
    return r


def test_late_first_token_is_429_at_the_deadline_then_shed_at_the_door():
    async def main():
        v = SlowPrefill(2.0)
        r = _router(v, 0.3)
        dev = r.tenants.by_name["dev"]
        body = {"prompt_ids": list(range(100))}
        t0 = time.perf_counter()
        with pytest.raises(Overloaded) as late:
            await r.open(dev, body)
        at_deadline = time.perf_counter() - t0
        await asyncio.sleep(0)
        # the queue drained without a rate sample: the next open is admitted, and fast ones measure the rate
        v.seconds = 0.1
        opened = await r.open(dev, body)
        r.prefill.started(10_000)  # a backlog the measured rate cannot clear within the deadline
        t0 = time.perf_counter()
        with pytest.raises(Overloaded) as door:
            await r.open(dev, body)
        at_door = time.perf_counter() - t0
        with pytest.raises(InvalidRequest):
            await r.open(dev, body, deadline_header="soon")
        return v, late.value, at_deadline, opened, door.value, at_door

    v, late, at_deadline, opened, door, at_door = asyncio.run(main())
    assert late.reason == "open_deadline_passed" and late.status == 429 and 0.3 <= at_deadline < 0.6
    assert v.cancelled == 1  # the late open's verifier call (its prefill) was dropped
    assert opened["session_id"] == "s.2"
    assert door.reason == "open_deadline" and at_door < 0.05 and v.calls == 2  # shed without a verifier call


def test_header_asks_for_a_shorter_deadline():
    async def main():
        v = SlowPrefill(1.0)
        r = _router(v, 5.0)
        t0 = time.perf_counter()
        with pytest.raises(Overloaded):
            await r.open(r.tenants.by_name["dev"], {"prompt_ids": [1, 2, 3]}, deadline_header="0.2")
        return time.perf_counter() - t0

    assert asyncio.run(main()) < 0.5


def test_the_deadline_counts_from_the_requests_arrival():
    """Time spent before the open is handled (reading its body) is part of its deadline."""
    async def main():
        v = SlowPrefill(1.0)
        r = _router(v, 0.5)
        tenant = r.tenants.by_name["dev"]
        t0 = time.perf_counter()
        with pytest.raises(Overloaded):  # arrived 0.3 s ago: 0.2 s left
            await r.open(tenant, {"prompt_ids": [1, 2, 3]}, received_at=t0 - 0.3)
        took = time.perf_counter() - t0
        with pytest.raises(Overloaded):  # arrived past its deadline: refused without a verifier call
            await r.open(tenant, {"prompt_ids": [1, 2, 3]}, received_at=time.perf_counter() - 0.6)
        return took, v.calls

    took, calls = asyncio.run(main())
    assert 0.15 < took < 0.45 and calls == 1
