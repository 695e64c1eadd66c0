"""Where draft forwards run: one thread, the round the server waits for first.
Notes: docs/edge_agent.md, "edge_agent/draft_executor.py"."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

CRITICAL = 0
PROACTIVE = 1


class DraftExecutor:
    """A single worker thread with a two-level priority queue of draft forwards."""

    def __init__(self, name: str = "drafter"):
        self._heap: list[tuple[int, int, Future, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the draft executor is shut down")
            heapq.heappush(self._heap, (priority, next(self._seq), fut, fn, args))
            self._cv.notify()
        return fut

    def queued(self) -> int:
        with self._cv:
            return len(self._heap)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return  # closed and drained
                _, _, fut, fn, args = heapq.heappop(self._heap)
            if not fut.set_running_or_notify_cancel():
                continue  # withdrawn before it started
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop taking work; what is queued is withdrawn, a forward in progress finishes and is
        waited for (one draft forward: milliseconds). A daemon thread still inside torch when the
        interpreter exits aborts the process ("terminate called without an active exception")."""
        with self._cv:
            self._closed = True
            for _, _, fut, _, _ in self._heap:
                fut.cancel()
            self._heap.clear()
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # -- asyncio ------------------------------------------------------------------------------
    async def run(self, priority: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the worker thread, awaited."""
        return await asyncio.wrap_future(self.submit(priority, fn, *args))

    async def run_until(self, done: asyncio.Future, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
        """Proactive ``fn(*args)``, withdrawn if ``done`` completes before it has started.

        Returns ``(True, result)`` when it ran, ``(False, None)`` when it was withdrawn. A forward
        already running is waited for (it holds the session's draft state)."""
        cf = self.submit(PROACTIVE, fn, *args)
        fut = asyncio.wrap_future(cf)
        await asyncio.wait({fut, done}, return_when=asyncio.FIRST_COMPLETED)
        if not fut.done() and cf.cancel():
            fut.cancel()
            return False, None
        return True, await fut
