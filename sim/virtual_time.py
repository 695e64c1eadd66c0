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
SLOWDOWN_EMA = 0.2  # weight of a worker's last task in its slowdown
MIN_CORES = 0.05  # what a burst of another process leaves the shared cores at least
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
        self._task_start = 0.0
        self._task_cpu = 0.0  # CPU seconds the running task spent so far
        self.cpu = 0.0  # CPU seconds every worker task spent so far
        self._elapsed = _unshared  # the running task's seconds for its CPU seconds so far (shared cores)

    def monotonic(self) -> float:
        return self.now if self._task_time is None else self._task_time

    def wall(self) -> float:
        return self.epoch + self.monotonic()

    def spend(self, seconds: float) -> None:
        """Work of ``seconds`` (CPU seconds) done by the running worker task."""
        if self._task_time is None:
            raise RuntimeError("spend() outside a worker task: only a worker's work takes virtual time")
        self._task_cpu += max(0.0, seconds)
        self.cpu += max(0.0, seconds)
        self._task_time = self._task_start + self._elapsed(self._task_cpu)

    def thread_time(self) -> float:
        """The CPU seconds worker tasks spent: a task's two reads differ by what it spent between them (a
        task runs whole, nothing else spends meanwhile)."""
        return self.cpu

    def begin_task(self, elapsed=None) -> None:
        """A worker task starts now; ``elapsed(cpu)``: its seconds for ``cpu`` CPU seconds (None: as many)."""
        self._task_time = self._task_start = self.now
        self._task_cpu, self._elapsed = 0.0, elapsed or _unshared

    def end_task(self) -> tuple[float, float]:
        """The running task's (end time, CPU seconds); reads are the loop's time again."""
        end, cpu = self._task_time, self._task_cpu
        self._task_time, self._elapsed = None, _unshared
        return end, cpu

    def blocking_sleep(self, seconds: float) -> None:
        self.spend(seconds)


def _unshared(cpu: float) -> float:
    return cpu


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


class SharedCores:
    """``cores`` CPUs shared by processes (processor sharing, as an OS scheduler shares them):
    each process (a :class:`VirtualWorker`) runs one task at a time, and the processes with a task
    split the cores in proportion to their ``weight`` (equal weights: ``min(1, cores / n)`` each),
    none above one core, what one cannot use going to the others. A task's seconds are CPU seconds:
    it completes when it has had that much CPU."""

    def __init__(self, loop: VirtualTimeLoop, cores: float):
        if cores <= 0:
            raise ValueError(f"cores must be positive, got {cores}")
        self.loop, self.cores = loop, cores
        self.tasks: dict[VirtualWorker, list] = {}  # worker -> [CPU seconds left, on_done]
        self.at = loop.time()  # when ``tasks``' seconds left were last brought up to date
        self._timer: asyncio.TimerHandle | None = None

    def rates(self) -> dict:
        """The share of a core each running process gets now."""
        rates, left, cores = {}, list(self.tasks), self.cores
        while left:
            total = sum(w.weight for w in left)
            capped = [w for w in left if cores * w.weight >= total]
            if not capped:
                rates.update((w, cores * w.weight / total) for w in left)
                break
            rates.update((w, 1.0) for w in capped)
            left, cores = [w for w in left if w not in capped], cores - len(capped)
        return rates

    def elapsed(self, worker: VirtualWorker, slowdown: float = 1.0):
        """``cpu -> seconds`` for a task ``worker`` starts now (its own clock reads, e.g. a forward's
        measured time), before the cores know when it ends: the CPU the other running tasks still
        need, up to what they get while it has its own (in proportion to their weights), shares the
        cores with it (exact on one core when no task arrives meanwhile), and at least ``slowdown``
        (the worker's recent seconds per CPU second: on a saturated host, work keeps arriving)."""
        self._settle()
        others = [(task[0], w.weight / worker.weight) for w, task in self.tasks.items() if w is not worker]
        return lambda cpu: max(cpu * slowdown, (cpu + sum(min(r, cpu * k) for r, k in others)) / self.cores)

    def run(self, worker: VirtualWorker, seconds: float, on_done) -> None:
        """``worker``'s task needs ``seconds`` of CPU; ``on_done()`` when it has had them."""
        self._settle()
        self.tasks[worker] = [seconds, on_done]
        self._arm()

    def set_cores(self, cores: float) -> None:
        """The CPUs shared from now on (another process takes some for a while: :func:`bursts`)."""
        if cores <= 0:
            raise ValueError(f"cores must be positive, got {cores}")
        self._settle()
        self.cores = cores
        self._arm()

    def _settle(self) -> None:
        now, rates = self.loop.time(), self.rates()
        for w, task in self.tasks.items():
            task[0] -= (now - self.at) * rates[w]
        self.at = now

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.tasks:
            rates = self.rates()
            left = min(max(0.0, task[0]) / rates[w] for w, task in self.tasks.items())
            self._timer = self.loop.call_at(self.at + left, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._settle()
        for worker in [w for w, task in self.tasks.items() if task[0] <= 1e-12]:
            self.tasks.pop(worker)[1]()  # may start that worker's next task
        self._arm()


async def bursts(cores: SharedCores, taken: float, length_s: float, every_s: float, phase_s: float) -> None:
    """Another process's periodic bursts of CPU (Ray's dashboard agent's, every 10 s): it takes ``taken``
    of ``cores``' CPUs for ``length_s`` every ``every_s``, the first at ``phase_s``; runs until cancelled."""
    base = cores.cores
    await asyncio.sleep(phase_s)
    while True:
        cores.set_cores(max(base - taken, MIN_CORES))
        await asyncio.sleep(length_s)
        cores.set_cores(base)
        await asyncio.sleep(every_s - length_s)


class VirtualWorker(Executor):
    """One worker thread in virtual time (``run_in_executor`` target). Tasks run in submission
    order, each when the previous one has finished; a task runs at once and whole, on the loop's
    thread, and its future completes after the seconds it spent (with ``cores``: once it has had
    that much of the shared cores' CPU)."""

    def __init__(self, loop: VirtualTimeLoop, cores: SharedCores | None = None, weight: float = 1.0):
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")
        self.loop, self.clock, self.cores, self.weight = loop, loop.clock, cores, weight  # weight: its claim on cores
        self.queue: collections.deque = collections.deque()
        self.busy = False
        self.busy_seconds = 0.0  # spent by all tasks
        self.slowdown = 1.0  # EMA of its tasks' seconds per CPU second on the shared cores

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
        self.clock.begin_task(self.cores.elapsed(self, self.slowdown) if self.cores is not None else None)
        start = self.clock.now
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as e:  # handed to the awaiting coroutine, as a thread would
            result, error = None, e
        finally:
            end, cpu = self.clock.end_task()
        self.busy_seconds += cpu
        if self.cores is None:
            self.loop.call_at(end, self._done, fut, result, error)
        else:
            self.cores.run(self, cpu, lambda: self._done(fut, result, error, start, cpu))

    def _done(self, fut: Future, result, error, start: float = 0.0, cpu: float = 0.0) -> None:
        if cpu > 0:  # what sharing the cores cost it, lately
            self.slowdown += SLOWDOWN_EMA * ((self.loop.time() - start) / cpu - self.slowdown)
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
