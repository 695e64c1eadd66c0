"""Virtual time for the production code: an asyncio event loop whose clock jumps to the next
timer when every task waits, and a one-thread executor whose work takes the seconds it spends.

:class:`VirtualClock` is what :func:`specdec.clock.use` installs; :class:`VirtualTimeLoop` runs
coroutines on it (``asyncio.sleep``, ``wait_for`` and timers are virtual); a
:class:`VirtualWorker` stands for a replica's worker thread: a task runs, whole, when the worker
is free (first come, first served), its clock reads include what it :meth:`VirtualClock.spend`s
(a modelled forward), and its future completes that much later. Nothing waits on the host's
clock, so the result depends only on the program and its seeds. Pure asyncio: no Ray.
"""

from __future__ import annotations

import asyncio
import collections
import selectors
from concurrent.futures import Executor, Future

EPOCH = 1_800_000_000.0  # the wall clock at virtual time 0
REAL_WAIT_S = 5.0  # a loop with no timer waits this long for real I/O (a thread) before giving up


class Stalled(RuntimeError):
    """Every task waits, no timer is set and nothing real arrives: the simulation cannot go on."""


class VirtualClock:
    """Simulated seconds. Inside a :class:`VirtualWorker` task the reads are the task's own time
    (its start plus what it spent so far)."""

    def __init__(self, start: float = 0.0, epoch: float = EPOCH):
        self.now = start
        self.epoch = epoch
        self._task_time: float | None = None  # set while a worker task runs

    def monotonic(self) -> float:
        return self.now if self._task_time is None else self._task_time

    def wall(self) -> float:
        return self.epoch + self.monotonic()

    def spend(self, seconds: float) -> None:
        """Work of ``seconds`` done by the running worker task."""
        if self._task_time is None:
            raise RuntimeError("spend() outside a worker task: only a worker's work takes virtual time")
        self._task_time += max(0.0, seconds)

    def blocking_sleep(self, seconds: float) -> None:
        self.spend(seconds)


class _VirtualSelector(selectors.SelectSelector):
    """Real file descriptors (the loop's self-pipe) are polled without blocking; a wait on a
    timer moves the virtual clock to it instead."""

    def __init__(self, clock: VirtualClock):
        super().__init__()
        self.clock = clock

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer: only a real thread could wake the loop
            ready = super().select(REAL_WAIT_S)
            if not ready:
                raise Stalled("every task waits and no timer is set")
            return ready
        self.clock.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on ``clock``: ``loop.time()`` is virtual time."""

    def __init__(self, clock: VirtualClock):
        super().__init__(selector=_VirtualSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


class VirtualWorker(Executor):
    """One worker thread in virtual time (``run_in_executor`` target). Tasks run in submission
    order, each when the previous one has finished; a task runs at once and whole, on the loop's
    thread, and its future completes after the seconds it spent."""

    def __init__(self, loop: VirtualTimeLoop):
        self.loop, self.clock = loop, loop.clock
        self.queue: collections.deque = collections.deque()
        self.busy = False
        self.busy_seconds = 0.0  # spent by all tasks

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        self.queue.append((fut, fn, args, kwargs))
        if not self.busy:
            self._next()
        return fut

    def _next(self) -> None:
        if not self.queue:
            self.busy = False
            return
        self.busy = True
        fut, fn, args, kwargs = self.queue.popleft()
        start = self.clock.now
        self.clock._task_time = start
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as e:  # handed to the awaiting coroutine, as a thread would
            result, error = None, e
        finally:
            end, self.clock._task_time = self.clock._task_time, None
        self.busy_seconds += end - start
        self.loop.call_at(end, self._done, fut, result, error)

    def _done(self, fut: Future, result, error) -> None:
        if fut.cancelled():  # its caller went away (a killed replica's loop): the work was done all the same
            pass
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
        self._next()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.queue.clear()


def run(main, clock: VirtualClock | None = None):
    """Run coroutine ``main`` on a fresh :class:`VirtualTimeLoop` with its clock installed as
    :mod:`specdec.clock`'s; the result of ``main``."""
    from specdec import clock as clocks

    clock = clock or VirtualClock()
    loop = VirtualTimeLoop(clock)
    try:
        with clocks.use(clock):
            return loop.run_until_complete(main)
    finally:
        loop.close()
