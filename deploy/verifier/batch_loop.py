"""The replica's continuous batching loop: when a forward runs, and what goes into it (SpecEdge §4.3).

:class:`BatchLoop` yields each :class:`Step` for the server to run; the order: docs/verifier.md, "The batch loop"."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from deploy.config import VerifierConfig
from deploy.verifier.batch_fill import ArrivalModel, fill_wait
from deploy.verifier.counters import ReplicaCounters
from deploy.verifier.forward_cost import PiecewiseCost
from deploy.verifier.open_queue import OpenQueue
from deploy.verifier.prefill_budget import PrefillBudget
from deploy.verifier.scheduler import FairScheduler, Pending
from specdec import clock

IDLE_WAKE_S = 5.0  # an idle loop wakes this often (idle sweeps)


@dataclass
class Step:
    """What the server runs next: ``sweep``, begin ``opens``, verify ``batch`` or prefill ``prefill`` tokens."""

    sweep: bool = False
    opens: list = field(default_factory=list)
    batch: list[Pending] = field(default_factory=list)
    prefill: int = 0


class BatchLoop:
    """The scheduler of verify rounds and the task that runs the replica's forwards."""

    def __init__(self, cfg: VerifierConfig, sched: FairScheduler, engine, cost: PiecewiseCost,
                 prefill: PrefillBudget, arrivals: ArrivalModel, counters: ReplicaCounters, opens: OpenQueue):
        self.cfg, self.sched, self.engine, self.cost = cfg, sched, engine, cost
        self.prefill, self.arrivals, self.counters, self.opens = prefill, arrivals, counters, opens
        self.wake: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        self.last_verify = 0.0  # when the last verify batch ran (monotonic)

    def ensure(self, run) -> None:
        """Start ``run(steps)`` (the server's driver of :meth:`steps`) in the running event loop, unless it runs."""
        if self.task is None or self.task.done():
            self.wake = asyncio.Event()
            self.task = asyncio.get_running_loop().create_task(run(self.steps()))

    def kick(self) -> None:
        if self.wake is not None:
            self.wake.set()

    def enqueue(self, p: Pending) -> None:
        """Queue a round and wake the loop (every round queued must wake it, a run-ahead step's included)."""
        self.sched.add(p)
        self.kick()

    async def steps(self):
        """The replica's steps, each decided when the one before it has run."""
        vc = self.cfg
        last_sweep = clock.monotonic()
        while True:
            if not len(self.sched) and not len(self.opens):
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=IDLE_WAKE_S)
                except asyncio.TimeoutError:
                    pass
            if vc.batch_wait_ms > 0 and self.others_may_join():
                await clock.sleep(vc.batch_wait_ms / 1000.0)  # let a few more requests join this forward
            await self.fill_batch()
            if clock.monotonic() - last_sweep > min(IDLE_WAKE_S, vc.idle_timeout_s / 2):
                yield Step(sweep=True)
                last_sweep = clock.monotonic()
            if self.opens.queued:
                yield Step(opens=self.opens.take())
            batch = self.sched.take(vc.max_batch_sessions, vc.max_batch_tokens)
            if batch:  # a prefill chunk rides along
                yield Step(batch=batch)
                self.last_verify = clock.monotonic()
            elif self.opens.prefilling:
                busy = self.decoding_recently()
                if busy and await self.request_arrives(max(0.002, 2 * self.prefill.verify_s)):
                    continue  # a verify round came back: the next chunk rides along with it
                # the edges are drafting (or gone): prefill in the gap
                yield Step(prefill=self.prefill.budget(len(self.opens.prefilling)) if busy else vc.max_batch_tokens)

    def decoding_recently(self) -> bool:
        """Whether a waiting prompt is prefilled in paced chunks: a session still decoding verified a moment ago."""
        if clock.monotonic() - self.last_verify >= max(0.05, 4 * self.prefill.verify_s):
            return False
        return any(not s.finished for s in list(self.engine.sessions.values()))  # a copy: closes run on the worker

    def others_may_join(self) -> bool:
        """Whether a request not yet queued could join the next forward (room, a session with no round queued)."""
        queued = len(self.sched.pending_sessions())
        return queued < min(self.cfg.max_batch_sessions, len(self.engine.sessions))

    async def fill_batch(self) -> None:
        """Hold the forward for the sessions due within ``batch_fill`` x its time, never past the first deadline."""
        vc = self.cfg
        if vc.batch_fill <= 0 or self.cost.count < 3 or not len(self.sched):
            return
        deadline = None
        while True:
            pending = self.sched.pending_sessions()
            rows = self.sched.pending_tokens()
            now = clock.monotonic()
            due = self.arrivals.due(now, pending, limit=max(vc.max_batch_sessions - len(pending), 0))
            wait = fill_wait(rows, due, rows / max(len(pending), 1),
                             self.cost.predict, vc.batch_fill, vc.max_batch_sessions, len(pending))
            if deadline is None:
                deadline = now + wait
            wait = min(wait, deadline - now)
            if wait <= 0.0005:
                return
            self.counters.fill_waits += 1
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=wait)
            except asyncio.TimeoutError:
                return

    async def request_arrives(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a verify request; whether one is queued."""
        if len(self.sched):
            return True
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            pass
        return bool(len(self.sched))
