"""Prometheus metrics of one edge agent (``prometheus_client``, optional HTTP port).
Notes: docs/edge_agent.md, "edge_agent/metrics.py"."""

from __future__ import annotations

from specdec.metrics import MetricSpec, PrometheusClientExporter

_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)

EDGE_METRICS: dict[str, MetricSpec] = {m.name: m for m in [
    MetricSpec("specedge_edge_generations", "counter", "Finished generations, by finish reason.",
               ("finish_reason",), component="edge"),
    MetricSpec("specedge_edge_generated_tokens", "counter", "Tokens generated (verified by the target).",
               component="edge"),
    MetricSpec("specedge_edge_spec_decode_num_drafts", "counter", "Verify rounds sent.", component="edge"),
    MetricSpec("specedge_edge_spec_decode_num_draft_tokens", "counter", "Draft tree nodes sent.", component="edge"),
    MetricSpec("specedge_edge_spec_decode_num_accepted_tokens", "counter",
               "Draft tokens the target accepted (bonus not counted).", component="edge"),
    MetricSpec("specedge_edge_draft_forwards", "counter", "Draft model forwards, by purpose.", ("kind",),
               component="edge"),
    MetricSpec("specedge_edge_proactive_align_attempts", "counter",
               "Rounds with proactive draft tokens in hand when the reply came.", component="edge"),
    MetricSpec("specedge_edge_proactive_aligned", "counter", "Complete draft alignments (SpecEdge 4.2).",
               component="edge"),
    MetricSpec("specedge_edge_proactive_reused_tokens", "counter", "Proactive tokens carried into the next tree.",
               component="edge"),
    MetricSpec("specedge_edge_reopens", "counter", "Sessions re-opened from the edge's history.", component="edge"),
    MetricSpec("specedge_edge_overload_waits", "counter", "429/503 answers waited out (Retry-After).",
               component="edge"),
    MetricSpec("specedge_edge_round_latency_seconds", "histogram", "Send-to-reply time of a verify round.",
               buckets=_S, component="edge"),
    MetricSpec("specedge_edge_rtt_seconds", "histogram", "Measured network round trip (pings).", buckets=_S,
               component="edge"),
    MetricSpec("specedge_edge_draft_forward_seconds", "histogram", "Time of one draft forward.", buckets=_S,
               component="edge"),
    MetricSpec("specedge_edge_ttft_seconds", "histogram", "Time to the first token of a generation.",
               buckets=_TTFT, component="edge"),
    MetricSpec("specedge_edge_generation_tokens_per_second", "histogram", "Tokens per second of a generation.",
               buckets=_TPS, component="edge"),
    MetricSpec("specedge_edge_mean_draft_depth", "gauge", "Mean draft depth of the last generation.",
               component="edge"),
    # edge-agent serve (edge_agent/server.py): the local OpenAI server's requests
    MetricSpec("specedge_edge_serve_requests", "counter", "Local OpenAI requests answered, by endpoint and "
                                                          "HTTP status.", ("endpoint", "status"), component="edge"),
    MetricSpec("specedge_edge_serve_requests_running", "gauge", "Local OpenAI generations in flight.",
               component="edge"),
]}


class EdgeMetrics:
    """The edge agent's exporter; ``registry`` defaults to a private one (many agents per process in tests)."""

    def __init__(self, registry=None):
        self._exp = PrometheusClientExporter(EDGE_METRICS.values(), registry)
        self.registry = self._exp.registry
        self._server = None

    def observe(self, stats) -> None:
        """Add one finished generation (:class:`edge_agent.agent.GenerationStats`)."""
        e = self._exp
        e.inc("specedge_edge_generations", 1, {"finish_reason": str(stats.finish_reason or "none")})
        e.inc("specedge_edge_generated_tokens", stats.tokens, {})
        e.inc("specedge_edge_spec_decode_num_drafts", stats.rounds, {})
        e.inc("specedge_edge_spec_decode_num_draft_tokens", stats.draft_tokens, {})
        e.inc("specedge_edge_spec_decode_num_accepted_tokens", stats.accepted_tokens, {})
        e.inc("specedge_edge_draft_forwards", stats.draft_forwards, {"kind": "tree"})
        e.inc("specedge_edge_draft_forwards", stats.proactive_forwards, {"kind": "proactive"})
        e.inc("specedge_edge_proactive_align_attempts", stats.align_attempts, {})
        e.inc("specedge_edge_proactive_aligned", stats.aligned, {})
        e.inc("specedge_edge_proactive_reused_tokens", stats.reused_tokens, {})
        e.inc("specedge_edge_reopens", stats.reopens, {})
        e.inc("specedge_edge_overload_waits", stats.overload_waits, {})
        for ms in stats.round_ms:
            e.observe("specedge_edge_round_latency_seconds", ms / 1e3, {})
        for ms in stats.rtt_ms:
            e.observe("specedge_edge_rtt_seconds", ms / 1e3, {})
        for ms in stats.draft_ms:
            e.observe("specedge_edge_draft_forward_seconds", ms / 1e3, {})
        e.observe("specedge_edge_ttft_seconds", stats.ttft_s, {})
        if stats.seconds > 0:
            e.observe("specedge_edge_generation_tokens_per_second", stats.tokens / stats.seconds, {})
        if stats.rounds:
            e.set("specedge_edge_mean_draft_depth", stats.depth_sum / stats.rounds, {})

    def on_request(self, endpoint: str, status: int) -> None:
        """A local OpenAI request answered (``edge-agent serve``)."""
        self._exp.inc("specedge_edge_serve_requests", 1, {"endpoint": endpoint, "status": str(status)})

    def set_running(self, n: int) -> None:
        self._exp.set("specedge_edge_serve_requests_running", n, {})

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Expose ``/metrics`` on ``addr:port`` (0 = any free port); returns the port."""
        import prometheus_client as pc

        if self._server is None:
            self._server, _thread = pc.start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
