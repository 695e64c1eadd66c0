"""The one clock of specdec, deploy and edge_agent: every time read and sleep goes through here.
Real by default; a simulation installs a virtual one with :func:`use` (docs/specdec.md)."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...  # seconds, for intervals and deadlines
    def wall(self) -> float: ...  # seconds since the epoch (timestamps users see)
    def blocking_sleep(self, seconds: float) -> None: ...  # a thread's sleep
    def thread_time(self) -> float: ...  # CPU seconds the calling thread has run (a simulated worker's: spent)


class RealClock:
    """The host's clocks."""

    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)
    blocking_sleep = staticmethod(time.sleep)
    thread_time = staticmethod(time.thread_time)


_clock: Clock = RealClock()


def monotonic() -> float:
    """Seconds on a clock that never goes back (intervals, deadlines)."""
    return _clock.monotonic()


def perf_counter() -> float:
    """Seconds for timing a piece of work (the same clock as :func:`monotonic` when simulated)."""
    return time.perf_counter() if type(_clock) is RealClock else _clock.monotonic()


def thread_time() -> float:
    """CPU seconds the calling thread has run (a forward's own CPU: the difference of two reads); when
    simulated, what the simulated workers have spent."""
    return time.thread_time() if type(_clock) is RealClock else _clock.thread_time()


def wall() -> float:
    """Seconds since the epoch."""
    return _clock.wall()


async def sleep(seconds: float, result=None):
    """``asyncio.sleep`` (on a virtual-time loop the sleep is virtual too)."""
    return await asyncio.sleep(seconds, result)


def blocking_sleep(seconds: float) -> None:
    """A thread's sleep."""
    _clock.blocking_sleep(seconds)


def current() -> Clock:
    return _clock


@contextmanager
def use(clock: Clock):
    """Run the block on ``clock``; the previous clock is back after it."""
    global _clock
    previous, _clock = _clock, clock
    try:
        yield clock
    finally:
        _clock = previous
