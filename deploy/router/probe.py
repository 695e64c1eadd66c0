"""Where a 429's time goes on the server: the router's event-loop lag and the shed answers' own time.

A shed request is decided without any verifier call, so what a client waits for it beyond the
network is (a) the router's event loop reaching the request (its lag: every other request's
work on the same loop, and the process waiting for a core) and (b) the answer itself (from
the request reaching the router's ASGI app to the response sent). :class:`LoadProbe` measures
both: ``run()`` sleeps ``interval_s`` over and over on the loop and records how late it wakes
(the lag an arriving request meets), and the router records each shed answer's time. It also
times the interpreter's garbage collections (``gc.callbacks``): a full collection over a
thousand sessions' objects stops the loop as a whole, which the lag alone cannot tell apart from
queued work. Each collection is recorded with its wall time, its thread's CPU time (wall well
above CPU: the process waited for a core mid-collection), its generation (2: a full one) and the
cyclic garbage it freed, so a long pause reads as a full walk, a preempted short one, or a pass
freeing a reference cycle some request path leaves behind. The load
test drains the samples once a second (``Router.probe_samples``) for its report; Prometheus
gets the same as histograms. Pure module (no Ray, no FastAPI).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from collections.abc import Callable


class LoadProbe:
    """Timestamped samples (epoch s, ms) of loop lag and of shed answers, bounded in memory."""

    def __init__(self, interval_s: float = 0.05, keep: int = 20_000,
                 on_lag: Callable[[float], None] | None = None):
        self.interval_s = interval_s
        self.lag: deque[tuple[float, float]] = deque(maxlen=keep)
        self.shed: deque[tuple[float, float]] = deque(maxlen=keep)
        self.gc_pause: deque[tuple[float, float]] = deque(maxlen=keep)  # (epoch s, wall ms) per collection
        self.gc_cpu: deque[tuple[float, float]] = deque(maxlen=keep)  # (epoch s, thread CPU ms) per collection
        self.gc_collected: deque[tuple[float, float]] = deque(maxlen=keep)  # (epoch s, unreachable objects freed)
        self.gc_gen: deque[tuple[float, float]] = deque(maxlen=keep)  # (epoch s, generation collected)
        self.on_lag = on_lag
        self._task: asyncio.Task | None = None
        self._gc_t0 = self._gc_cpu0 = 0.0

    def start(self) -> None:
        """Start the lag sampler on the running loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0, self._gc_cpu0 = time.perf_counter(), time.thread_time()
            return
        now, wall_ms = time.time(), (time.perf_counter() - self._gc_t0) * 1e3
        self.gc_pause.append((now, wall_ms))
        self.gc_cpu.append((now, (time.thread_time() - self._gc_cpu0) * 1e3))
        self.gc_collected.append((now, float(info.get("collected", 0))))
        self.gc_gen.append((now, float(info.get("generation", -1))))

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - t0 - self.interval_s)
            self.lag.append((time.time(), lag * 1e3))
            if self.on_lag is not None:
                self.on_lag(lag)

    def shed_answered(self, seconds: float) -> None:
        self.shed.append((time.time(), seconds * 1e3))

    def drain(self) -> dict[str, list[tuple[float, float]]]:
        """The samples since the last drain, and forget them."""
        kept = {"loop_lag_ms": self.lag, "shed_ms": self.shed, "gc_pause_ms": self.gc_pause,
                "gc_cpu_ms": self.gc_cpu, "gc_collected": self.gc_collected, "gc_gen": self.gc_gen}
        out = {k: list(v) for k, v in kept.items()}
        for v in kept.values():
            v.clear()
        return out
