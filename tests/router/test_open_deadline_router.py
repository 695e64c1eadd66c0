"""Router.open against its deadline (issues 56, 67): the remaining deadline goes to the verifier
(which drops an open whose prefill has not started by then), an idle router admits any open
whatever it measured, a measured backlog is shed at the door, a prompt over the limit is a 400."""

from __future__ import annotations

import asyncio
import time

import pytest

from deploy.router.ingress import Router
from specdec.errors import InvalidRequest, Overloaded


class FakePrefill:
    """A verifier handle whose open_session takes ``seconds`` and records the deadline it was
    given; ``late``: answer as a replica that dropped the open at its deadline."""

    def __init__(self, seconds: float, late: bool = False):
        self.seconds, self.late, self.calls, self.deadlines = seconds, late, 0, []
        self.open_session = self

    def remote(self, **kwargs):
        self.deadlines.append(kwargs["deadline_s"])
        return self._open()

    async def _open(self):
        self.calls += 1
        await asyncio.sleep(self.seconds)
        if self.late:
            return 429, {"error": {"code": "overloaded", "message": "did not start", "retry_after": 1.0,
                                   "reason": "open_deadline_passed"}}
        return 200, {"session_id": f"s.{self.calls}", "first_token": 1, "prefix_len": 1}


def _router(verifier, deadline_s: float, **router):
    """The Router class under Serve's ingress wrapper (whose constructor is Serve's to await)."""
    cls = next(c for c in Router.func_or_class.__mro__[1:] if c.__name__ == "Router")
    r = cls.__new__(cls)
    cls.__init__(r, verifier, {"router": {"open_deadline_s": deadline_s, **router}})
    return r


def test_a_cold_first_open_never_locks_an_idle_router():
    """The issue's reproduction: a 2-token open that took 3 s, then longer opens on an idle
    server: admitted, each (the forecast's estimate is not asked with nothing queued)."""
    async def main():
        v = FakePrefill(0.3)
        r = _router(v, 0.2)
        dev = r.tenants.by_name["dev"]
        await r.open(dev, {"prompt_ids": [300, 301]})  # longer than its deadline: its own work
        v.seconds = 0.01
        return [await r.open(dev, {"prompt_ids": list(range(n))}) for n in (32, 500, 2000)], r

    opened, r = asyncio.run(main())
    assert len(opened) == 3 and r.prefill.shed == 0


def test_the_verifier_gets_the_remaining_deadline_and_its_late_answer_is_a_429():
    async def main():
        v = FakePrefill(0.05, late=True)
        r = _router(v, 5.0)
        dev = r.tenants.by_name["dev"]
        with pytest.raises(Overloaded) as late:
            await r.open(dev, {"prompt_ids": [1, 2, 3]}, deadline_header="0.5", received_at=time.perf_counter() - 0.2)
        # arrived past its deadline with nothing queued ahead: the verifier decides, with 0 s (it starts the head
        # of its queue, whatever the deadline; this one answers as a replica with another open ahead: 429)
        with pytest.raises(Overloaded):
            await r.open(dev, {"prompt_ids": [1, 2, 3]}, received_at=time.perf_counter() - 6.0)
        r.prefill.started(100)  # behind another open: refused without a verifier call
        with pytest.raises(Overloaded) as gone:
            await r.open(dev, {"prompt_ids": [1, 2, 3]}, received_at=time.perf_counter() - 6.0)
        with pytest.raises(InvalidRequest):
            await r.open(dev, {"prompt_ids": [1, 2, 3]}, deadline_header="soon")
        return v, r, late.value, gone.value

    v, r, late, gone = asyncio.run(main())
    assert v.calls == 2 and 0.25 < v.deadlines[0] <= 0.3  # the header's 0.5 s less the 0.2 s since arrival
    assert v.deadlines[1] == 0.0
    assert late.status == 429 and late.reason == "open_deadline_passed" and late.retry_after > 0
    assert gone.reason == "open_deadline_passed"
    assert r.prefill.cost.known and r.prefill.queued_opens == 1  # the cut opens are (lower-bound) samples


def test_a_measured_backlog_is_shed_at_the_door_without_a_verifier_call():
    async def main():
        v = FakePrefill(0.1)
        r = _router(v, 0.3)
        dev = r.tenants.by_name["dev"]
        await r.open(dev, {"prompt_ids": list(range(100))})  # ~0.1 s an open measured
        for _ in range(10):  # a backlog of ~1 s ahead
            r.prefill.started(100)
        t0 = time.perf_counter()
        with pytest.raises(Overloaded) as door:
            await r.open(dev, {"prompt_ids": list(range(100))})
        return v, door.value, time.perf_counter() - t0

    v, door, at_door = asyncio.run(main())
    assert door.reason == "open_deadline" and door.status == 429 and v.calls == 1
    assert at_door < v.seconds  # answered before a verifier call could have been


def test_a_prompt_over_max_prompt_tokens_is_a_400_even_when_shedding():
    async def main():
        v = FakePrefill(0.01)
        r = _router(v, 0.3)
        dev = r.tenants.by_name["dev"]
        await r.open(dev, {"prompt_ids": [1, 2]})
        r.prefill.started(10_000_000)  # the forecast would refuse anything now
        with pytest.raises(InvalidRequest) as e:
            await r.open(dev, {"prompt_ids": [1] * 9000})
        return v, e.value

    v, e = asyncio.run(main())
    assert e.status == 400 and "max_prompt_tokens" in str(e) and v.calls == 1
