"""Continuous-batching scheduler: which pending requests go into the next forward.

SpecEdge §4.3; tenants share a forward by weight (weighted fair queueing on virtual time), FIFO within one."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Pending:
    tenant: str
    session_id: str
    tokens: int  # forward tokens this request adds (tree nodes + root, or prompt)
    payload: Any = None
    enqueued_at: float = 0.0


@dataclass
class FairScheduler:
    weights: dict[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    _queues: "OrderedDict[str, deque[Pending]]" = field(default_factory=OrderedDict)
    _vtime: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add(self, p: Pending) -> None:
        q = self._queues.setdefault(p.tenant, deque())
        if not q:  # a tenant returning from idle does not get credit for the time it was away
            floor = min((self._vtime[t] for t, qq in self._queues.items() if qq and t in self._vtime), default=0.0)
            self._vtime[p.tenant] = max(self._vtime.get(p.tenant, 0.0), floor)
        q.append(p)

    def pending_sessions(self) -> set[str]:
        return {p.session_id for q in self._queues.values() for p in q}

    def pending_tokens(self) -> int:
        return sum(p.tokens for q in self._queues.values() for p in q)

    def pending_by_tenant(self) -> dict[str, int]:
        return {t: len(q) for t, q in self._queues.items() if q}

    def take(self, max_sessions: int, max_tokens: int) -> list[Pending]:
        """Pop the next batch: lowest virtual time first; one request per session."""
        batch: list[Pending] = []
        used = 0
        sessions: set[str] = set()
        skipped: dict[str, list[Pending]] = {}
        while len(batch) < max_sessions:
            live = [t for t, q in self._queues.items() if q]
            if not live:
                break
            t = min(live, key=lambda x: self._vtime.get(x, 0.0))
            p = self._queues[t].popleft()
            if p.session_id in sessions or (batch and used + p.tokens > max_tokens):
                skipped.setdefault(t, []).append(p)  # next forward
                if all(not q for q in self._queues.values()):
                    break
                continue
            batch.append(p)
            sessions.add(p.session_id)
            used += p.tokens
            self._vtime[t] = self._vtime.get(t, 0.0) + p.tokens / self.weights.get(t, self.default_weight)
        for t, ps in skipped.items():
            self._queues[t].extendleft(reversed(ps))
        return batch
