"""The replica's own counters: what its forwards and requests did, for ``GET /v1/stats``.

Totals are monotonic; ``forwards`` and ``round_latencies`` keep the recent ones only. Pure module."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specdec import clock
from specdec.engine import ForwardStats

MAX_FORWARDS = 4096  # recent forwards kept; past it the older half is dropped


@dataclass
class Takeovers:
    """How the edge's next request found its session's detached run (:mod:`deploy.verifier.run_ahead`)."""

    running: int = 0  # still decoding: no forward missed
    full: int = 0  # it sat out the forwards since: run_ahead_tokens too small for the round trip
    stopped: int = 0  # it stopped otherwise (finished, or trees pay again)


@dataclass
class ReplicaCounters:
    """Counters of one replica, updated by its batch loop and request handlers."""

    forwards: list[ForwardStats] = field(default_factory=list)  # recent forwards, for tests and stats
    # recent verify rounds: (arrival, seconds from arrival to reply), monotonic clock
    round_latencies: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=8192))
    busy_seconds: float = 0.0
    prefill_cpu_seconds: float = 0.0  # the prefill forwards' own CPU time
    verify_cpu_seconds: float = 0.0  # the verify forwards' own CPU time
    verify_forwards: int = 0
    verify_sessions: int = 0  # sessions in the verify forwards
    verify_rows: int = 0  # rows in the verify forwards
    prefill_tokens: int = 0  # prompt tokens computed: prefill forwards and chunks riding verify forwards
    requests: int = 0  # verify requests answered
    request_seconds: float = 0.0  # the seconds they spent in this replica
    fill_waits: int = 0  # forwards held for sessions due back (batch filling)
    tokens_emitted: int = 0  # verified tokens returned to clients (first tokens included)
    takeovers: Takeovers = field(default_factory=Takeovers)
    started: float = field(default_factory=clock.monotonic)

    def on_forward(self, st: ForwardStats) -> None:
        self.busy_seconds += st.seconds
        if st.kind == "prefill":
            self.prefill_cpu_seconds += st.cpu_seconds
            self.prefill_tokens += st.tokens
        else:
            self.verify_cpu_seconds += st.cpu_seconds
            self.prefill_tokens += st.prefill_tokens
            self.verify_forwards += 1
            self.verify_sessions += st.sessions
            self.verify_rows += st.tokens
        self.forwards.append(st)
        if len(self.forwards) > MAX_FORWARDS:
            del self.forwards[:MAX_FORWARDS // 2]

    def on_request(self, seconds: float) -> None:
        """A verify request answered after ``seconds`` here (queue, batch wait, forward(s), reply)."""
        self.requests += 1
        self.request_seconds += seconds

    def to_dict(self) -> dict:
        """The counters under their ``/v1/stats`` keys."""
        return {"forwards": len(self.forwards),
                "verify_forwards": sum(1 for f in self.forwards if f.kind != "prefill"),
                "tokens_emitted": self.tokens_emitted, "busy_seconds": self.busy_seconds,
                "busy_cpu_seconds": {"prefill": self.prefill_cpu_seconds, "verify": self.verify_cpu_seconds},
                "uptime_seconds": clock.monotonic() - self.started,
                "batch_sizes": [f.sessions for f in self.forwards if f.kind == "verify"],
                "verify_forwards_total": self.verify_forwards, "verify_sessions_total": self.verify_sessions,
                "verify_rows_total": self.verify_rows, "prefill_tokens_total": self.prefill_tokens,
                "verify_requests_total": self.requests, "verify_request_seconds_total": self.request_seconds,
                "run_ahead_takeovers": {"running": self.takeovers.running, "full": self.takeovers.full,
                                        "stopped": self.takeovers.stopped}}
