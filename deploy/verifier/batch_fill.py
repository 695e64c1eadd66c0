"""Batch filling: wait for the rounds that are about to arrive before starting a forward (SpecEdge §4.3).

Why: docs/engine.md, "Batch filling"; how: docs/verifier.md. Pure module: no Ray, no asyncio; the clock is passed in."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class ArrivalModel:
    """When each session's next verify round is due: its last reply + an EMA of its away time."""

    ema: float = 0.3
    max_away_s: float = 1.0  # away longer than this is not a round trip (think time, a re-open)
    _replied: dict[str, float] = field(default_factory=dict)  # sid -> time of its last reply
    _away: dict[str, float] = field(default_factory=dict)  # sid -> EMA of seconds away
    _heap: list[tuple[float, float, float, str]] = field(default_factory=list)  # (due at, due until, replied at, sid)

    def replied(self, sid: str, now: float) -> None:
        self._replied[sid] = now
        away = self._away.get(sid)
        if away is not None:  # a session without a round trip measured yet is never due
            heapq.heappush(self._heap, _due_entry(sid, now, away))
            if len(self._heap) > 2 * len(self._replied) + 64:
                self._rebuild()

    def arrived(self, sid: str, now: float) -> None:
        t = self._replied.pop(sid, None)
        if t is None:
            return
        away = now - t
        if away > self.max_away_s:
            return  # not a round trip: keep the estimate it had
        old = self._away.get(sid)
        self._away[sid] = away if old is None else (1 - self.ema) * old + self.ema * away

    def forget(self, sid: str) -> None:
        self._replied.pop(sid, None)
        self._away.pop(sid, None)

    def prune(self, live: Iterable[str]) -> None:
        """Drop sessions that are gone (closed, evicted, finished)."""
        keep = set(live)
        for d in (self._replied, self._away):
            for sid in [s for s in d if s not in keep]:
                del d[sid]
        self._rebuild()

    def due(self, now: float, exclude: set[str], limit: int) -> list[float]:
        """Seconds until the ``limit`` soonest away sessions (not in ``exclude``) are expected back, sorted; an
        overdue one counts as due now while late by less than its away time (``now`` never goes back)."""
        out: list[float] = []
        kept, seen = [], set()
        while self._heap and len(out) < limit:
            entry = heapq.heappop(self._heap)
            at, until, replied_at, sid = entry
            if self._replied.get(sid) != replied_at or now > until or sid in seen:
                continue  # back already, replied again, gone, or late past its away time
            kept.append(entry)
            seen.add(sid)
            if sid not in exclude:
                out.append(max(at - now, 0.0))
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return out

    def _rebuild(self) -> None:
        self._heap = [_due_entry(sid, t, a) for sid, t in self._replied.items() if (a := self._away.get(sid)) is not None]
        heapq.heapify(self._heap)


def _due_entry(sid: str, replied_at: float, away: float) -> tuple[float, float, float, str]:
    """A heap entry of :class:`ArrivalModel`: due at, due until (late by less than its away time), replied at, sid."""
    return replied_at + away, replied_at + away + max(away, 0.005), replied_at, sid


def fill_wait(pending_rows: int, due: list[float], rows_per_session: float,
              cost: Callable[[int], float], fill: float, max_sessions: int, pending_sessions: int) -> float:
    """Seconds to hold the next forward: until the last session due within ``fill`` x the forward's predicted
    time (with it in the batch); 0 when none is. ``due``: :meth:`ArrivalModel.due`; ``cost(rows)``: seconds."""
    if fill <= 0 or not due or pending_sessions <= 0:
        return 0.0
    wait = 0.0
    room = max_sessions - pending_sessions
    for j, dt in enumerate(due[:max(room, 0)], start=1):
        if dt > fill * cost(int(pending_rows + j * rows_per_session)):
            break
        wait = dt
    return wait
