"""Where a request's time goes on the server: the router's event-loop lag, the shed answers' own time and
the admitted verify rounds' verifier calls.

:class:`LoadProbe` samples loop lag, shed answers, verifier calls and collections (docs/router.md, "Where a 429's
time goes")."""

from __future__ import annotations

import asyncio
import gc
import logging
import selectors
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from specdec import clock


class LoadProbe:
    """Timestamped samples (epoch s, ms) of loop lag and of shed answers, bounded in memory."""

    def __init__(self, interval_s: float = 0.05, keep: int = 20_000,
                 on_lag: Callable[[float], None] | None = None, stall_log_s: float = 0.0,
                 log: logging.Logger | None = None):
        self.interval_s = interval_s
        self.stall_log_s = stall_log_s  # 0: no watchdog
        self.log = log or logging.getLogger(__name__)
        self.last_tick = clock.monotonic()  # when the sampler last ran (the watchdog's clock)
        self.lag: deque[tuple[float, float]] = deque(maxlen=keep)
        self.shed: deque[tuple[float, float]] = deque(maxlen=keep)
        self.verify: deque[tuple[float, float]] = deque(maxlen=keep)  # admitted verify rounds' verifier calls
        self.gc_pause: deque[tuple[float, float]] = deque(maxlen=keep)  # (epoch s, wall ms) per collection
        self.gc_cpu: deque[tuple[float, float]] = deque(maxlen=keep)  # (epoch s, thread CPU ms) per collection
        self.gc_collected: deque[tuple[float, float]] = deque(maxlen=keep)  # (epoch s, unreachable objects freed)
        self.gc_gen: deque[tuple[float, float]] = deque(maxlen=keep)  # (epoch s, generation collected)
        self.on_lag = on_lag
        self.on_verify: Callable[[float], None] | None = None  # also told each verifier call's seconds
        self._task: asyncio.Task | None = None
        self._gc_t0 = self._gc_cpu0 = 0.0

    def start(self) -> None:
        """Start the lag sampler on the running loop (once)."""
        if self._task is None:
            self.last_tick = clock.monotonic()
            self._task = asyncio.get_running_loop().create_task(self.run())
            gc.callbacks.append(self._on_gc)
            if self.stall_log_s > 0:
                threading.Thread(target=self._watch, args=(threading.get_ident(),), daemon=True,
                                 name="loop-stall-watch").start()

    def _watch(self, loop_thread: int) -> None:
        """Log the loop thread's stack once per stall over ``stall_log_s`` (none while it waits in its
        selector: the lag is then the host's, not the loop's code); ends with the sampler."""
        reported = None
        while not self._task.done():
            clock.blocking_sleep(min(self.stall_log_s / 4, 0.5))
            tick = self.last_tick
            stalled = clock.monotonic() - tick
            if stalled > self.stall_log_s and tick != reported:
                frame = sys._current_frames().get(loop_thread)
                if frame is not None and frame.f_code.co_filename == selectors.__file__:
                    continue  # idle in its selector, whose timeout is the sampler's: the host held the thread, not our code
                stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
                self.log.warning("the event loop has not run for %.1f s; where it is:\n%s", stalled, stack)
                reported = tick

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0, self._gc_cpu0 = clock.perf_counter(), clock.thread_time()
            return
        now, wall_ms = clock.wall(), (clock.perf_counter() - self._gc_t0) * 1e3
        self.gc_pause.append((now, wall_ms))
        self.gc_cpu.append((now, (clock.thread_time() - self._gc_cpu0) * 1e3))
        self.gc_collected.append((now, float(info.get("collected", 0))))
        self.gc_gen.append((now, float(info.get("generation", -1))))

    async def run(self) -> None:
        while True:
            t0 = clock.perf_counter()
            await clock.sleep(self.interval_s)
            self.last_tick = clock.monotonic()
            lag = max(0.0, clock.perf_counter() - t0 - self.interval_s)
            self.lag.append((clock.wall(), lag * 1e3))
            if self.on_lag is not None:
                self.on_lag(lag)

    def shed_answered(self, seconds: float) -> None:
        self.shed.append((clock.wall(), seconds * 1e3))

    def verify_answered(self, seconds: float) -> None:
        """An admitted verify round's verifier call took ``seconds`` (admission to its reply read)."""
        self.verify.append((clock.wall(), seconds * 1e3))
        if self.on_verify is not None:
            self.on_verify(seconds)

    def drain(self) -> dict[str, list[tuple[float, float]]]:
        """The samples since the last drain, and forget them."""
        kept = {"loop_lag_ms": self.lag, "shed_ms": self.shed, "verify_ms": self.verify, "gc_pause_ms": self.gc_pause,
                "gc_cpu_ms": self.gc_cpu, "gc_collected": self.gc_collected, "gc_gen": self.gc_gen}
        out = {k: list(v) for k, v in kept.items()}
        for v in kept.values():
            v.clear()
        return out
