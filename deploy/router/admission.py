"""Router-side admission control: shed with 429 *before* a request queues.

:class:`AdmissionControl` bounds one router's requests in flight; the router calls :meth:`check`, :meth:`started`
and :meth:`finished` around each verifier call. The rules and why: docs/router.md, "Admission control"."""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field

from specdec import clock
from specdec.errors import Overloaded


def inflight_limit(max_pending: int, max_queued_batches: int | None, batch_sessions: int, verifier_replicas: int,
                   batches_running: int = 1, router_replicas: int = 1) -> int:
    """Requests one router lets in flight: running + queued batches over all verifier replicas
    (``batches_running`` > 1 with pipeline stages), capped by ``max_pending``, split over routers."""
    limit = max_pending
    if max_queued_batches is not None:
        limit = min(limit, (batches_running + max_queued_batches) * batch_sessions * verifier_replicas)
    return max(1, limit // router_replicas)


@dataclass
class AdmissionControl:
    limit: int  # requests in flight to the verifiers before shedding starts
    weights: dict[str, float] = field(default_factory=dict)  # tenant -> scheduling weight
    retry_after_s: float = 1.0  # the Retry-After while shedding is rare
    max_retry_after_s: float = 30.0
    window_s: float = 1.0
    objective_s: float | None = None  # p99 of admitted verify latency the cap is fitted to; None: static cap
    min_limit: int = 4
    min_samples: int = 20  # completions the horizon needs before it moves the cap
    horizon: int = 5  # windows whose latencies the p99 is taken over
    inflight: int = 0
    retry_after: float = field(init=False)
    max_limit: int = field(init=False)  # the static cap (point 1); an objective moves limit below it
    by_tenant: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _window_start: float | None = None
    _admitted: int = 0
    _shed: int = 0
    _latencies: list[float] = field(default_factory=list)  # admitted verifies finished in this window (s)
    _recent: deque = field(default_factory=deque)  # the latencies of the last ``horizon`` windows
    _peak: int = 0  # most requests in flight during this window
    # tenant -> when one of its running sessions' rounds was last shed at the cap
    _round_shed_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.limit = max(1, self.limit)
        self.max_limit = self.limit
        self.min_limit = min(max(1, self.min_limit), self.max_limit)
        self.retry_after = self.retry_after_s

    # -- decisions ------------------------------------------------------------------------
    def check(self, tenant: str, kind: str = "verify", now: float | None = None) -> None:
        """Raise :class:`Overloaded` (429) if ``tenant``'s ``kind`` request must be shed, else count it as admitted."""
        refused = self.refusal(tenant, kind, now)
        if refused is not None:
            try:
                raise refused
            finally:  # this frame, in the 429's traceback, must not hold the 429: a reference
                del refused  # cycle per shed round, ~35 ms of garbage collection in the router every 2 s at 1000 users
        self._admitted += 1

    def refusal(self, tenant: str, kind: str = "verify", now: float | None = None) -> Overloaded | None:
        """The 429 a ``kind`` request of ``tenant`` gets now (counted as shed), or None (which does not admit it)."""
        now = clock.monotonic() if now is None else now
        self._roll(now)
        half = max(1, self.limit // 2)
        if kind == "open":
            rounds_shed = now - self._round_shed_at.get(tenant, -math.inf) < self.window_s
            if rounds_shed or (self.inflight >= half and self.by_tenant.get(tenant, 0) >= self.fair_share(tenant) / 2):
                why = "its running sessions' rounds are being shed" if rounds_shed else \
                    f"{self.inflight} requests in flight"
                return self._refuse(f"the verifier is busy ({why}); running sessions go first", "new_sessions_paused",
                                    self.retry_after)
        if self.inflight >= self.limit and self.by_tenant.get(tenant, 0) >= self.fair_share(tenant):
            retry_after = self.retry_after
            if kind == "verify":  # a running session's round: its tenant's new sessions wait a window (point 3),
                # and it the base Retry-After (the cap drains within a few batch times; the adaptive one would stall it)
                self._round_shed_at[tenant], retry_after = now, self.retry_after_s
            return self._refuse(f"{self.inflight} requests are in flight to the verifier (limit {self.limit}); "
                                "it is saturated", "queue_full", retry_after)
        return None

    def fair_share(self, tenant: str) -> float:
        """``tenant``'s share of ``limit`` by weight, among the tenants with requests in flight."""
        active = {t for t, n in self.by_tenant.items() if n > 0} | {tenant}
        total = sum(self.weights.get(t, 1.0) for t in active)
        return self.limit * self.weights.get(tenant, 1.0) / total

    def _refuse(self, message: str, reason: str, retry_after: float) -> Overloaded:
        self._shed += 1
        return Overloaded(message, retry_after=retry_after, reason=reason)

    # -- observations -----------------------------------------------------------------------
    def started(self, tenant: str) -> None:
        self.inflight += 1
        self.by_tenant[tenant] += 1
        self._peak = max(self._peak, self.inflight)

    def finished(self, tenant: str, latency_s: float | None = None) -> None:
        """``latency_s``: an admitted verify's duration (feeds the objective); None for other calls."""
        self.inflight -= 1
        self.by_tenant[tenant] -= 1
        if latency_s is not None and self.objective_s is not None:
            self._latencies.append(latency_s)

    def _roll(self, now: float) -> None:
        """Close the window: adapt the Retry-After to the fraction shed."""
        if self._window_start is None:
            self._window_start = now
        if now - self._window_start < self.window_s:
            return
        total = self._admitted + self._shed
        if total and self._shed / total > 0.25:
            self.retry_after = min(self.max_retry_after_s, self.retry_after * 1.5)
        elif not total or self._shed / total < 0.05:
            self.retry_after = max(self.retry_after_s, self.retry_after * 0.7)
        self._fit_limit()
        self._window_start = now
        self._admitted = self._shed = 0
        self._peak = self.inflight

    def _fit_limit(self) -> None:
        """Move the cap toward the latency objective (the p99 of the last ``horizon`` windows)."""
        self._recent.append(self._latencies)
        self._latencies = []
        while len(self._recent) > self.horizon:
            self._recent.popleft()
        lat = sorted(x for w in self._recent for x in w)
        if self.objective_s is None or len(lat) < self.min_samples:
            return
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        if p99 > self.objective_s:
            shrink = max(0.8, 0.9 * self.objective_s / p99)
            self.limit = max(self.min_limit, int(self.limit * shrink))
        elif p99 < 0.7 * self.objective_s and self._peak >= 0.8 * self.limit:
            self.limit = min(self.max_limit, self.limit + max(1, self.limit // 10))

    def snapshot(self) -> dict:
        return {"inflight": self.inflight, "limit": self.limit, "max_limit": self.max_limit,
                "objective_s": self.objective_s, "retry_after_s": round(self.retry_after, 2)}
