"""Periodic CPU bursts of a server's background processes (Ray's dashboard agent: about 0.6 of a core
for about a second every 10 s on this host, the period of Ray's metrics export), measured finely
enough to model them.

:class:`BurstSampler` sums the CPU of a set of processes every ``period_s`` (a thread; the set can
change as processes come and go, a new process's CPU so far is not a burst); :func:`burst_profile`
reads a window of its samples as a steady part and bursts: how often, how long, how many cores.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass

from benchmarks.proc_stats import CLK, read_stat

BURST_ABOVE_CORES = 0.25  # a sample this far above the window's median rate is in a burst
BURST_GAP_S = 0.25  # samples in bursts at most this far apart are one burst
MIN_BURST_CPU_S = 0.2  # a burst's CPU beyond the steady rate, at least (a sample or two above is a blip)


class BurstSampler:
    """A thread that reads the watched processes' CPU every ``period_s``: ``samples`` is a list of
    ``(epoch s, CPU seconds so far)``, the CPU summed over the processes since each was first seen."""

    def __init__(self, period_s: float = 0.1):
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self._pids: set[int] = set()
        self._last: dict[int, int] = {}  # pid -> its ticks at the last read
        self._cpu_ticks = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="burst-sampler", daemon=True)

    def watch(self, pids) -> None:
        """Sample these processes from now on (and no others)."""
        with self._lock:
            self._pids = set(pids)

    def start(self) -> "BurstSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        """One read of the watched processes (the thread's step)."""
        with self._lock:
            pids = set(self._pids)
        for pid in pids:
            st = read_stat(pid)
            if st is None:  # gone
                self._last.pop(pid, None)
                continue
            before = self._last.get(pid)
            self._last[pid] = st.own_ticks
            if before is not None:
                self._cpu_ticks += st.own_ticks - before
        self.samples.append((time.time(), self._cpu_ticks / CLK))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()


@dataclass(frozen=True)
class BurstProfile:
    """A window of background CPU as a steady rate plus bursts: ``every_s`` apart on average,
    ``length_s`` long each, taking ``cores`` beyond the steady rate while they last."""

    steady_cores: float
    every_s: float
    length_s: float
    cores: float
    bursts: int
    window_s: float

    @property
    def mean_cores(self) -> float:
        """The bursts' CPU averaged over the window."""
        return mean_cores(self.to_dict())

    def to_dict(self) -> dict:
        return asdict(self)


def burst_profile(samples: list[tuple[float, float]], lo: float, hi: float) -> BurstProfile | None:
    """The bursts in ``samples`` (``(t, CPU seconds so far)``, as :class:`BurstSampler` takes them)
    between ``lo`` and ``hi``: a sample's rate more than ``BURST_ABOVE_CORES`` above the window's
    median is in a burst; bursts closer than ``BURST_GAP_S`` are one. None without two bursts (or
    without samples): no period to speak of."""
    pts = [(t, c) for t, c in samples if lo <= t <= hi]
    steps = [(t0, t1, (c1 - c0) / (t1 - t0)) for (t0, c0), (t1, c1) in zip(pts, pts[1:]) if t1 > t0]
    if len(steps) < 3:
        return None
    steady = statistics.median(r for _, _, r in steps)
    found: list[list[float]] = []  # [start, end, CPU beyond the steady rate]
    for t0, t1, r in steps:
        if r <= steady + BURST_ABOVE_CORES:
            continue
        if found and t0 - found[-1][1] <= BURST_GAP_S:
            found[-1][1] = t1
            found[-1][2] += (r - steady) * (t1 - t0)
        else:
            found.append([t0, t1, (r - steady) * (t1 - t0)])
    found = [b for b in found if b[2] >= MIN_BURST_CPU_S]
    if len(found) < 2:
        return None
    every = (found[-1][0] - found[0][0]) / (len(found) - 1)
    length = statistics.fmean(b[1] - b[0] for b in found)
    cores = sum(b[2] for b in found) / sum(b[1] - b[0] for b in found)
    return BurstProfile(steady, every, length, cores, len(found), pts[-1][0] - pts[0][0])


def mean_cores(bursts: dict) -> float:
    """Bursts' CPU averaged over time, of a profile's fields ``cores``, ``length_s`` and ``every_s``
    (:meth:`BurstProfile.to_dict`, or the mean of several)."""
    return bursts["cores"] * bursts["length_s"] / bursts["every_s"]


def profile_dict(samples: list[tuple[float, float]], lo: float, hi: float) -> dict | None:
    """:func:`burst_profile` as the dict a run's JSON keeps; None without a period."""
    profile = burst_profile(samples, lo, hi)
    return profile.to_dict() if profile else None
