"""A session's pacing hints: the draft depth and tree budget its next round is asked for (SpecEdge §4.3).

They rest on the session's version pacer (its own acceptance, FlexSpec §III-C,
:mod:`deploy.verifier.versions`), on what its edge reported (draft time, RTT, run-ahead) and on the
sessions sharing the verifier, counted as the most open within ``pacing.sessions_hold_s``: when a
generation ends its session closes and the edge opens the next a round trip later, and counted out
meanwhile the sessions left would look alone, and be asked for trees where run-ahead pays.
Pure module: no Ray, no asyncio.
"""

from __future__ import annotations


from deploy.verifier.pacing import Pacer
from deploy.verifier.sessions import EdgeClient, SessionBook
from deploy.verifier.versions import TargetVersions
from specdec import clock


class SessionHints:
    """The hints of each session of one replica."""

    def __init__(self, versions: TargetVersions, sessions: SessionBook, engine, hold_s: float):
        self.versions, self.sessions, self.engine, self.hold_s = versions, sessions, engine, hold_s
        self._load_peak = (0, 0.0)  # (most sessions open lately, when)

    def load_sessions(self) -> int:
        """Sessions sharing the verifier, as the tree budget weighs them."""
        now, n = clock.monotonic(), max(len(self.engine.sessions), 1)
        peak, at = self._load_peak
        if n >= peak or now - at > self.hold_s:
            self._load_peak = (n, now)
            return n
        return peak

    def pacing(self, sid: str) -> tuple[Pacer, int, EdgeClient]:
        """What a session's hints rest on: its version's pacer, the load, what its edge reported."""
        edge = self.sessions.edge(sid)
        return self.versions.pacer(sid, edge.draft), self.load_sessions(), edge

    def hints(self, sid: str) -> tuple[int, int]:
        """``(depth_hint, budget_hint)`` for the session's reply (a budget hint may explore)."""
        pacer, n, edge = self.pacing(sid)
        budget = pacer.budget_hint(n, edge.ahead, edge.rtt_ms / 1000.0)
        return pacer.depth_hint(n, budget, edge.draft_ms, edge.rtt_ms), budget

    def best_budget(self, sid: str) -> int:
        """The budget the pacer deems best now (never explores): 0 lets a run decode on."""
        pacer, n, edge = self.pacing(sid)
        return pacer.best_budget(n, edge.ahead, edge.rtt_ms / 1000.0)
