"""Prometheus metrics of the cloud side, in vLLM's three layers: stats -> aggregator -> exporter.

Bounded labels, each metric declared once in :data:`METRICS`; acceptance length: docs/router.md, "Metrics"."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from specdec import clock
from specdec.metrics import Exporter, MetricSpec, PrometheusClientExporter, never_raises

log = logging.getLogger("ray.serve")

MAX_POSITIONS = 32  # accepted-token positions broken out (the default max tree depth); deeper ones are not
MAX_TRACKED_SESSIONS = 65_536  # per-session last-reply times kept for the inter-token latency

_LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_WAIT_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SESSIONS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_DEPTH = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
_NODES = (0.5, 1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)  # le=0.5: empty trees (server-only AR)
# vLLM's buckets for its time-to-first-token and end-to-end request latency histograms
_TTFT_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0, 2560.0)
_E2E_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
          960.0, 1920.0, 7680.0)


def _c(name, desc, labels=(), component="verifier"):
    return MetricSpec("specedge_" + name, "counter", desc, tuple(labels), (), component)


def _h(name, desc, buckets, labels=(), component="verifier"):
    return MetricSpec("specedge_" + name, "histogram", desc, tuple(labels), tuple(buckets), component)


def _g(name, desc, labels=(), component="verifier"):
    return MetricSpec("specedge_" + name, "gauge", desc, tuple(labels), (), component)


TM = ("tenant", "mode")
TMV = TM + ("version",)  # version: the target version (target.adapters name, or "base"), FlexSpec §III
METRICS: dict[str, MetricSpec] = {m.name: m for m in [
    # -- spec decode (vLLM names), per tenant, mode and target version ----------------------
    _c("spec_decode_num_drafts", "Verify rounds (one draft tree or chain each).", TMV),
    _c("spec_decode_num_draft_tokens", "Draft tokens (tree nodes) verified (sent minus those the replica cut).",
       TMV),
    _c("spec_decode_num_truncated_tokens", "Draft tokens sent but not verified: server-side truncation at batch "
                                           "time (specdec/truncation.py).", TMV),
    _c("spec_decode_num_accepted_tokens", "Draft tokens accepted (the bonus token not counted).", TMV),
    _c("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position on the accepted path.",
       TMV + ("position",)),
    _c("spec_decode_num_emitted_tokens", "Tokens emitted by verify rounds (accepted + bonus).", TMV),
    _c("sessions_opened", "Sessions opened (prefilled), re-opens included.", ("tenant",)),
    _c("prefill_tokens", "Prompt + history tokens prefilled at open.", ("tenant",)),
    _c("prefix_cache_hit_tokens", "Of the prompt + history tokens at open, those taken from the prefix cache "
                                  "(not computed; hit rate = this / prefill_tokens).", ("tenant",)),
    # -- requests as vLLM counts them (a request = a session: open to finishing reply) --------------
    _h("time_to_first_token_seconds", "From an open reaching the replica to its first token (the open's reply; "
                                      "re-opens from history not counted).", _TTFT_S, ("tenant",)),
    _h("e2e_request_latency_seconds", "From an open reaching the replica to the reply that finishes the session "
                                      "(EOS, stop token, max_tokens).", _E2E_S, ("tenant",)),
    _c("prompt_tokens", "Prompt tokens prefilled for new sessions (a re-open's history not counted).", ("tenant",)),
    _c("generation_tokens", "Tokens generated: the opens' first tokens and every token a verify round emitted.",
       ("tenant",)),
    _c("request_success", "Sessions finished, by finish reason.", ("tenant", "finished_reason")),
    _g("num_requests_running", "Sessions this replica holds (opened and not closed or finished)."),
    _g("num_requests_waiting", "Opens waiting for their prefill or being prefilled in this replica."),
    # -- the verifier's forwards and queue ----------------------------------------------------
    _h("verify_batch_sessions", "Sessions in one target forward (with a prefill chunk riding along, if any).",
       _SESSIONS, ("kind",)),
    _h("verify_batch_tokens", "Tokens in one target forward (packed, never padded).", _TOKENS, ("kind",)),
    _h("forward_latency_seconds", "Wall time of one target forward.", _LATENCY_S, ("kind",)),
    _c("verifier_busy_seconds", "Seconds the replica spent in target forwards (rate = utilisation).", ("kind",)),
    _c("forward_sessions", "Sessions summed over target forwards (exact mean batch size with the histogram count).",
       ("kind",)),
    _c("forward_tokens", "Real tokens summed over target forwards.", ("kind",)),
    _h("queue_wait_seconds", "Time a verify request waited before its forward started.", _WAIT_S, ("tenant",)),
    _h("inter_token_latency_seconds",
       "Time between two replies of a session divided by the tokens the later reply emitted.", _LATENCY_S, TM),
    _h("draft_tree_nodes", "Draft tree (or chain) size per verify round.", _NODES, TM),
    # -- edge telemetry from each VerifyFrame -------------------------------------------------
    _h("edge_reported_rtt_seconds", "Edge-measured network round trip, as reported in verify frames.", _LATENCY_S,
       ("tenant",)),
    _h("edge_reported_draft_forward_seconds", "Edge-measured time of one draft forward, as reported.", _LATENCY_S,
       ("tenant",)),
    _h("edge_reported_draft_depth", "Draft forwards (depth) the edge chose for a tree.", _DEPTH, ("tenant",)),
    # -- replica state ------------------------------------------------------------------------
    _g("open_sessions", "Sessions held by this replica.", ("tenant",)),
    _g("kv_tokens_in_use", "KV-cache tokens held by this replica's sessions."),
    _g("kv_tokens_capacity", "KV-cache token budget of this replica (LRU eviction above it)."),
    _g("pending_requests", "Requests queued for this replica's next forwards."),
    _c("evictions", "Sessions evicted (KV budget or idle timeout).", ("reason",)),
    _g("pacing_depth_hint", "Mean draft depth hinted to edges since the last update (SpecEdge 4.3)."),
    _g("pacing_budget_hint", "Mean tree budget (nodes) hinted to edges since the last update."),
    _g("forward_cost_fixed_seconds", "Fitted fixed cost a of a forward, t = a + b * max(0, rows - knee)."),
    _g("forward_cost_per_token_seconds", "Fitted marginal cost b per row above the knee."),
    _g("forward_cost_knee_rows", "Rows up to which a forward costs the same (memory-bound)."),
    # -- router ---------------------------------------------------------------------------------
    _h("router_verify_latency_seconds", "End-to-end verify latency at the router (successful rounds).",
       _LATENCY_S, ("tenant",), component="router"),
    _g("router_inflight_requests", "Requests the router has in flight to verifiers.", component="router"),
    _c("router_errors", "Errors answered to clients, by HTTP status and error code.", ("status", "code"),
       component="router"),
    _c("router_shed_requests", "Requests shed with 429/503 + Retry-After, by reason.", ("reason",),
       component="router"),
    _h("router_shed_answer_seconds", "Server-side time of a 429 answered without a verifier call (from the "
                                     "request reaching the router's ASGI app, or its frame the WebSocket loop, "
                                     "to the answer).", _WAIT_S,
       component="router"),
    _h("router_event_loop_lag_seconds", "How late the router's event loop runs a timer (sampled 20 times a "
                                        "second): the wait any arriving request meets.", _WAIT_S,
       component="router"),
]}


# -- exporters -------------------------------------------------------------------------------------
class RayServeExporter:
    """``ray.serve.metrics`` Counter/Histogram/Gauge, created in the replica that exports them."""

    def __init__(self, specs: Iterable[MetricSpec]):
        from ray.serve import metrics as rsm

        cls = {"counter": rsm.Counter, "gauge": rsm.Gauge}
        self._m: dict[str, Any] = {}
        for s in specs:
            if s.kind == "histogram":
                self._m[s.name] = rsm.Histogram(s.name, description=s.description, boundaries=list(s.buckets),
                                                tag_keys=s.labels or None)
            else:
                self._m[s.name] = cls[s.kind](s.name, description=s.description, tag_keys=s.labels or None)

    def inc(self, name, value, labels):
        if value:
            self._m[name].inc(value, tags=labels)

    def observe(self, name, value, labels):
        self._m[name].observe(value, tags=labels)

    def set(self, name, value, labels):
        self._m[name].set(value, tags=labels)


def specs_for(component: str) -> list[MetricSpec]:
    return [s for s in METRICS.values() if s.component == component]


def default_exporter(component: str) -> Exporter:
    """:class:`RayServeExporter` inside a Serve replica, else a private prometheus_client registry."""
    specs = specs_for(component)
    try:
        from ray.serve import context
    except ImportError:
        return PrometheusClientExporter(specs)
    if context._get_internal_replica_context() is not None:
        try:
            return RayServeExporter(specs)
        except Exception:  # noqa: BLE001 - a metrics problem must not stop the replica
            log.exception("metrics: Ray Serve metrics unavailable; keeping them in-process only")
    return PrometheusClientExporter(specs)


# -- stats -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoundStats:
    """One verify round of one session."""

    tenant: str
    mode: str  # "tree" | "chain"
    draft_tokens: int
    accepted: int  # draft tokens on the accepted path
    emitted: int  # tokens this round adds to the output
    finished: bool
    truncated: int = 0  # nodes sent but cut by the replica (not verified)
    version: str = "base"  # the session's target version
    finish_reason: str | None = None  # "stop" | "length" when it finished

    @classmethod
    def of(cls, tenant: str, req, res, version: str = "base") -> "RoundStats":
        """From the engine's ``VerifyRequest``/``VerifyResult`` or ``ChainVerifyRequest``/``ChainVerifyResult``."""
        if hasattr(req, "tree"):
            return cls(tenant, "tree", res.verified, len(res.accepted), len(res.tokens), res.finished,
                       len(req.tree) - res.verified, version, res.finish_reason)
        # chain: a rejected round emits no bonus; the residual sample it owes arrives with the next frame
        emitted = res.num_accepted + (res.bonus is not None) + (req.resampled is not None)
        return cls(tenant, "chain", len(req.tokens), res.num_accepted, emitted, res.finished, version=version,
                   finish_reason=res.finish_reason)


@dataclass(frozen=True)
class EdgeTelemetry:
    """What an edge reports in each ``VerifyFrame`` (0 = not measured yet)."""

    tenant: str
    draft_ms: float
    rtt_ms: float
    depth: int

    @classmethod
    def of(cls, tenant: str, frame) -> "EdgeTelemetry":
        return cls(tenant, float(frame.draft_ms), float(frame.rtt_ms), int(frame.depth))


@dataclass(frozen=True)
class VerifierState:
    """A snapshot of one verifier replica."""

    sessions_by_tenant: dict[str, int]
    kv_tokens: int
    kv_capacity: int
    pending: int
    cost_fixed_s: float
    cost_per_token_s: float
    cost_knee_rows: float = 0.0
    waiting: int = 0  # opens not yet prefilled

    @classmethod
    def of(cls, core) -> "VerifierState":
        """Read a :class:`deploy.verifier.server.VerifierServer` (attributes only, no calls into Serve)."""
        by_tenant: dict[str, int] = {}
        for tenant in list(core.owner.values()):
            by_tenant[tenant] = by_tenant.get(tenant, 0) + 1
        a, b, knee = core.pacer.cost.coefficients()
        return cls(by_tenant, core.engine.kv_tokens(), core.kv_plan.budget_tokens,
                   core.pending(), a, b, knee, len(core.opens))


def _remember(book: "OrderedDict[str, float]", sid: str, t: float) -> None:
    """``book[sid] = t``, the oldest entries dropped beyond :data:`MAX_TRACKED_SESSIONS`."""
    book[sid] = t
    book.move_to_end(sid)
    while len(book) > MAX_TRACKED_SESSIONS:
        book.popitem(last=False)


# -- aggregators -----------------------------------------------------------------------------------
@dataclass
class VerifierMetrics:
    """Turns a verifier replica's stats into metric updates (bounded labels only)."""

    exporter: Exporter
    tenants: Sequence[str] = ()
    refresh_s: float = 1.0
    clock: Any = clock.monotonic
    _last_reply: "OrderedDict[str, float]" = field(default_factory=OrderedDict)
    _arrived: "OrderedDict[str, float]" = field(default_factory=OrderedDict)  # sid -> when its open arrived
    _seen_tenants: set[str] = field(default_factory=set)
    _last_refresh: float = float("-inf")
    _hints: list[int] = field(default_factory=lambda: [0, 0, 0])  # depth sum, budget sum, rounds

    @classmethod
    def create(cls, tenants: Sequence[str] = ()) -> "VerifierMetrics":
        """Ray Serve metrics inside a replica; a private prometheus_client registry elsewhere."""
        return cls(default_exporter("verifier"), tuple(tenants))

    def __post_init__(self):
        self._seen_tenants.update(self.tenants)

    # events ------------------------------------------------------------------------
    @never_raises
    def on_forward(self, st) -> None:
        """One target forward (``specdec.engine.ForwardStats``)."""
        e, kind = self.exporter, {"kind": st.kind}
        e.observe("specedge_verify_batch_sessions", st.sessions, kind)
        e.observe("specedge_verify_batch_tokens", st.tokens, kind)
        e.observe("specedge_forward_latency_seconds", st.seconds, kind)
        e.inc("specedge_verifier_busy_seconds", st.seconds, kind)
        e.inc("specedge_forward_sessions", st.sessions, kind)
        e.inc("specedge_forward_tokens", st.tokens, kind)

    @never_raises
    def on_batch_start(self, batch: Iterable) -> None:
        """Queue wait of each request (``scheduler.Pending``) as its forward starts."""
        now = self.clock()
        for p in batch:
            self.exporter.observe("specedge_queue_wait_seconds", max(now - p.enqueued_at, 0.0), {"tenant": p.tenant})

    @never_raises
    def on_frame(self, tenant: str, frame) -> None:
        self.record_edge(EdgeTelemetry.of(tenant, frame))

    def record_edge(self, t: EdgeTelemetry) -> None:
        lab = {"tenant": t.tenant}
        if t.rtt_ms > 0:
            self.exporter.observe("specedge_edge_reported_rtt_seconds", t.rtt_ms / 1e3, lab)
        if t.draft_ms > 0:
            self.exporter.observe("specedge_edge_reported_draft_forward_seconds", t.draft_ms / 1e3, lab)
        if t.depth > 0:
            self.exporter.observe("specedge_edge_reported_draft_depth", t.depth, lab)

    @never_raises
    def on_arrival(self, sid: str) -> None:
        """An open reached the replica (the start of its TTFT and end-to-end latency)."""
        _remember(self._arrived, sid, self.clock())

    @never_raises
    def on_open(self, tenant: str, sid: str, prefix_len: int, cached_tokens: int = 0, first_token: bool = False,
                finish_reason: str | None = None) -> None:
        """An open answered; ``first_token``: it sampled one (not a re-open); ``finish_reason``: that token ended it."""
        self._seen_tenants.add(tenant)
        lab, now = {"tenant": tenant}, self.clock()
        self.exporter.inc("specedge_sessions_opened", 1, lab)
        self.exporter.inc("specedge_prefill_tokens", prefix_len, lab)
        self.exporter.inc("specedge_prefix_cache_hit_tokens", cached_tokens, lab)
        if first_token:
            self.exporter.inc("specedge_prompt_tokens", prefix_len - 1, lab)
            self.exporter.inc("specedge_generation_tokens", 1, lab)
            if sid in self._arrived:
                self.exporter.observe("specedge_time_to_first_token_seconds", now - self._arrived[sid], lab)
        else:  # a re-open: its request began before this replica saw it
            self._arrived.pop(sid, None)
        if finish_reason is not None:
            self._finished(tenant, sid, finish_reason, now)
        self._touch(sid, now)  # the open reply carries the first token

    def _finished(self, tenant: str, sid: str, reason: str, now: float) -> None:
        lab = {"tenant": tenant}
        self.exporter.inc("specedge_request_success", 1, {**lab, "finished_reason": reason})
        start = self._arrived.pop(sid, None)
        if start is not None:
            self.exporter.observe("specedge_e2e_request_latency_seconds", now - start, lab)

    @never_raises
    def on_round(self, tenant: str, sid: str, req, res, depth_hint: int = 0, budget_hint: int = 0,
                 version: str = "base") -> None:
        self.record_round(RoundStats.of(tenant, req, res, version), sid)
        h = self._hints
        h[0] += depth_hint
        h[1] += budget_hint
        h[2] += 1

    def record_round(self, r: RoundStats, sid: str | None = None) -> None:
        e, lab = self.exporter, {"tenant": r.tenant, "mode": r.mode}
        vlab = {**lab, "version": r.version}
        e.inc("specedge_spec_decode_num_drafts", 1, vlab)
        e.inc("specedge_spec_decode_num_draft_tokens", r.draft_tokens, vlab)
        e.inc("specedge_spec_decode_num_truncated_tokens", r.truncated, vlab)
        e.inc("specedge_spec_decode_num_accepted_tokens", r.accepted, vlab)
        e.inc("specedge_spec_decode_num_emitted_tokens", r.emitted, vlab)
        for pos in range(min(r.accepted, MAX_POSITIONS)):
            e.inc("specedge_spec_decode_num_accepted_tokens_per_pos", 1, {**vlab, "position": str(pos)})
        e.observe("specedge_draft_tree_nodes", r.draft_tokens, lab)
        e.inc("specedge_generation_tokens", r.emitted, {"tenant": r.tenant})
        if sid is None:
            return
        now = self.clock()
        if r.finished:
            self._finished(r.tenant, sid, r.finish_reason or "stop", now)
        last = self._last_reply.get(sid)
        if last is not None and r.emitted > 0:
            e.observe("specedge_inter_token_latency_seconds", (now - last) / r.emitted, lab)
        if r.finished:
            self._last_reply.pop(sid, None)
        else:
            self._touch(sid, now)

    @never_raises
    def on_evict(self, sid: str, reason: str) -> None:
        self._last_reply.pop(sid, None)
        self._arrived.pop(sid, None)
        self.exporter.inc("specedge_evictions", 1, {"reason": reason})

    def _touch(self, sid: str, now: float) -> None:
        _remember(self._last_reply, sid, now)

    # gauges ----------------------------------------------------------------------------
    @never_raises
    def refresh(self, core, force: bool = False) -> VerifierState | None:
        """Update the gauges from ``core`` at most every ``refresh_s`` (the batch loop calls it)."""
        now = self.clock()
        if not force and now - self._last_refresh < self.refresh_s:
            return None
        self._last_refresh = now
        state = VerifierState.of(core)
        self.record_state(state)
        return state

    def record_state(self, s: VerifierState) -> None:
        e = self.exporter
        self._seen_tenants.update(s.sessions_by_tenant)
        for t in sorted(self._seen_tenants):
            e.set("specedge_open_sessions", s.sessions_by_tenant.get(t, 0), {"tenant": t})
        e.set("specedge_kv_tokens_in_use", s.kv_tokens, {})
        e.set("specedge_kv_tokens_capacity", s.kv_capacity, {})
        e.set("specedge_pending_requests", s.pending, {})
        e.set("specedge_num_requests_running", sum(s.sessions_by_tenant.values()), {})
        e.set("specedge_num_requests_waiting", s.waiting, {})
        e.set("specedge_forward_cost_fixed_seconds", s.cost_fixed_s, {})
        e.set("specedge_forward_cost_per_token_seconds", s.cost_per_token_s, {})
        e.set("specedge_forward_cost_knee_rows", s.cost_knee_rows, {})
        depth, budget, n = self._hints
        if n:
            e.set("specedge_pacing_depth_hint", depth / n, {})
            e.set("specedge_pacing_budget_hint", budget / n, {})
            self._hints = [0, 0, 0]


@dataclass
class RouterMetrics:
    """The router's view: end-to-end verify latency, errors by status/code, shedding by reason."""

    exporter: Exporter

    @classmethod
    def create(cls) -> "RouterMetrics":
        return cls(default_exporter("router"))

    @never_raises
    def on_verify(self, tenant: str, seconds: float, inflight: int) -> None:
        self.exporter.observe("specedge_router_verify_latency_seconds", seconds, {"tenant": tenant})
        self.exporter.set("specedge_router_inflight_requests", inflight, {})

    @never_raises
    def on_shed_answered(self, seconds: float) -> None:
        self.exporter.observe("specedge_router_shed_answer_seconds", seconds, {})

    @never_raises
    def on_loop_lag(self, seconds: float) -> None:
        self.exporter.observe("specedge_router_event_loop_lag_seconds", seconds, {})

    @never_raises
    def on_error(self, e) -> None:
        """A ``specdec.errors.SpecError`` about to be answered (HTTP or WebSocket)."""
        status = int(getattr(e, "status", 500))
        self.exporter.inc("specedge_router_errors", 1, {"status": str(status), "code": str(getattr(e, "code", "error"))})
        reason = getattr(e, "reason", None)
        if status in (429, 503) and reason:
            self.exporter.inc("specedge_router_shed_requests", 1, {"reason": str(reason)})


_router: RouterMetrics | None = None


def router_metrics() -> RouterMetrics:
    """The router replica's metrics (one per process: the FastAPI error handler is module-level)."""
    global _router
    if _router is None:
        _router = RouterMetrics.create()
    return _router
