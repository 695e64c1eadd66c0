"""deploy.metrics and edge_agent.metrics: stats -> aggregator -> exporter, on real prometheus_client registries."""

from __future__ import annotations

import re
import urllib.request

import pytest

from deploy.metrics import (MAX_POSITIONS, METRICS, EdgeTelemetry, PrometheusClientExporter, RoundStats,
                            RouterMetrics, VerifierMetrics, VerifierState, specs_for)
from specdec.errors import InvalidRequest, Overloaded, SessionEvicted
from specdec.protocol import VerifyFrame
from specdec.engine import (ChainVerifyRequest, ChainVerifyResult, ForwardStats, VerifyRequest,
                                    VerifyResult)
from deploy.verifier.scheduler import Pending
from specdec.tree import DraftTree
from edge_agent.agent import GenerationStats
from edge_agent.metrics import EDGE_METRICS, EdgeMetrics


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def vm():
    exp = PrometheusClientExporter(specs_for("verifier"))
    return VerifierMetrics(exp, tenants=("alpha", "beta"), clock=Clock())


def val(m, name, **labels):
    return m.exporter.registry.get_sample_value(name, labels) if hasattr(m, "exporter") else \
        m.registry.get_sample_value(name, labels)


def tree_round(tree_tokens, parents, accepted, bonus, finished=False, verified=None):
    req = VerifyRequest("s1", DraftTree(tuple(tree_tokens), tuple(parents)), 10)
    toks = tuple(tree_tokens[i] for i in accepted) + ((bonus,) if bonus is not None else ())
    res = VerifyResult("s1", tuple(accepted), bonus, toks, 10 + len(toks), finished, "stop" if finished else None,
                       len(tree_tokens) if verified is None else verified)
    return req, res


def test_metric_table_is_well_formed():
    names = [re.sub(r"_total$", "", s.exposed("")) for s in list(METRICS.values()) + list(EDGE_METRICS.values())]
    assert len(set(names)) == len(names)
    for s in list(METRICS.values()) + list(EDGE_METRICS.values()):
        assert re.fullmatch(r"specedge_[a-z0-9_]+", s.name), s.name
        assert s.description.isascii(), s.name  # Ray's Cython metrics reject non-ASCII descriptions
        assert s.kind in ("counter", "histogram", "gauge")
        assert not {"session", "session_id", "sid"} & set(s.labels), "no unbounded labels"
        if s.kind == "histogram":
            assert s.buckets and all(b > 0 for b in s.buckets), "Ray needs positive boundaries"
            assert list(s.buckets) == sorted(set(s.buckets))
        else:
            assert not s.buckets
    assert METRICS["specedge_spec_decode_num_drafts"].exposed() == "ray_specedge_spec_decode_num_drafts_total"
    assert METRICS["specedge_kv_tokens_in_use"].exposed() == "ray_specedge_kv_tokens_in_use"


@pytest.mark.parametrize("accepted", [[], [0], [0, 2], [0, 2, 3]])
def test_tree_round_counters_follow_vllm(vm, accepted):
    # tree: 0 -> 1, 0 -> 2 -> 3, root children 0 and 4
    tokens, parents = [5, 6, 7, 8, 9], [-1, 0, 0, 2, -1]
    req, res = tree_round(tokens, parents, accepted, bonus=11)
    vm.on_round("alpha", "s1", req, res, depth_hint=4, budget_hint=32)
    lab = {"tenant": "alpha", "mode": "tree"}
    vlab = {**lab, "version": "base"}  # spec-decode counters carry the target version
    assert val(vm, "specedge_spec_decode_num_drafts_total", **vlab) == 1
    assert val(vm, "specedge_spec_decode_num_draft_tokens_total", **vlab) == 5
    assert val(vm, "specedge_spec_decode_num_accepted_tokens_total", **vlab) == len(accepted)
    assert val(vm, "specedge_spec_decode_num_emitted_tokens_total", **vlab) == len(accepted) + 1
    for pos in range(4):
        got = val(vm, "specedge_spec_decode_num_accepted_tokens_per_pos_total", position=str(pos), **vlab)
        assert (got or 0) == (1 if pos < len(accepted) else 0)
    assert val(vm, "specedge_draft_tree_nodes_count", **lab) == 1


def test_spec_decode_counters_are_split_by_target_version(vm):
    """FlexSpec §III: the frozen draft's acceptance per target version (LoRA adapter)."""
    req, res = tree_round([5, 6, 7, 8, 9], [-1, 0, 0, 2, -1], [0, 2, 3], bonus=11)
    vm.on_round("alpha", "s1", req, res, version="code")
    req, res = tree_round([5, 6, 7, 8, 9], [-1, 0, 0, 2, -1], [], bonus=11)
    vm.on_round("alpha", "s2", req, res)
    lab = {"tenant": "alpha", "mode": "tree"}
    assert val(vm, "specedge_spec_decode_num_accepted_tokens_total", version="code", **lab) == 3
    assert val(vm, "specedge_spec_decode_num_accepted_tokens_total", version="base", **lab) == 0
    assert val(vm, "specedge_spec_decode_num_drafts_total", version="code", **lab) == 1


def test_truncated_rounds_count_verified_and_cut_nodes(vm):
    req, res = tree_round([5, 6, 7, 8, 9], [-1, 0, 0, 2, -1], [0], bonus=11, verified=2)
    vm.on_round("alpha", "s1", req, res)
    lab = {"tenant": "alpha", "mode": "tree", "version": "base"}
    assert val(vm, "specedge_spec_decode_num_draft_tokens_total", **lab) == 2
    assert val(vm, "specedge_spec_decode_num_truncated_tokens_total", **lab) == 3


def test_chain_round_counts_resampled_token(vm):
    req = ChainVerifyRequest("c", (1, 2, 3, 4), (0.5, 0.5, 0.5, 0.5), 7, resampled=9)
    res = ChainVerifyResult("c", num_accepted=2, bonus=None, reject_top_ids=(3,), reject_top_probs=(1.0,),
                            prefix_len=10)
    r = RoundStats.of("beta", req, res)
    assert (r.mode, r.draft_tokens, r.accepted, r.emitted) == ("chain", 4, 2, 3)  # 2 accepted + owed residual
    vm.record_round(r)
    assert val(vm, "specedge_spec_decode_num_accepted_tokens_total", tenant="beta", mode="chain",
               version="base") == 2


def test_accepted_positions_are_bounded(vm):
    vm.record_round(RoundStats("alpha", "chain", 100, 100, 101, False))
    assert val(vm, "specedge_spec_decode_num_accepted_tokens_per_pos_total", tenant="alpha", mode="chain",
               version="base", position=str(MAX_POSITIONS - 1)) == 1
    assert val(vm, "specedge_spec_decode_num_accepted_tokens_per_pos_total", tenant="alpha", mode="chain",
               version="base", position=str(MAX_POSITIONS)) is None


def test_inter_token_latency_uses_time_between_replies(vm):
    clock = vm.clock
    vm.on_open("alpha", "s1", prefix_len=12)
    clock.t += 0.3
    req, res = tree_round([5, 6, 7], [-1, 0, 1], [0, 1, 2], bonus=4)  # 4 tokens in 0.3 s
    vm.on_round("alpha", "s1", req, res)
    clock.t += 0.1
    req, res = tree_round([5], [-1], [], bonus=4, finished=True)  # 1 token in 0.1 s
    vm.on_round("alpha", "s1", req, res)
    lab = {"tenant": "alpha", "mode": "tree"}
    assert val(vm, "specedge_inter_token_latency_seconds_count", **lab) == 2
    assert val(vm, "specedge_inter_token_latency_seconds_sum", **lab) == pytest.approx(0.075 + 0.1)
    assert "s1" not in vm._last_reply  # finished sessions are forgotten
    assert val(vm, "specedge_sessions_opened_total", tenant="alpha") == 1
    assert val(vm, "specedge_prefill_tokens_total", tenant="alpha") == 12


def test_forward_queue_edge_and_eviction(vm):
    vm.on_forward(ForwardStats("verify", sessions=3, tokens=40, seconds=0.05))
    vm.on_forward(ForwardStats("prefill", sessions=1, tokens=30, seconds=0.02))
    assert val(vm, "specedge_verify_batch_sessions_sum", kind="verify") == 3
    assert val(vm, "specedge_verify_batch_tokens_sum", kind="verify") == 40
    assert val(vm, "specedge_verifier_busy_seconds_total", kind="verify") == pytest.approx(0.05)
    assert val(vm, "specedge_forward_tokens_total", kind="verify") == 40
    assert val(vm, "specedge_forward_sessions_total", kind="prefill") == 1

    vm.on_batch_start([Pending("alpha", "s1", 5, None, vm.clock.t - 0.02), Pending("beta", "s2", 5, None, vm.clock.t)])
    assert val(vm, "specedge_queue_wait_seconds_sum", tenant="alpha") == pytest.approx(0.02)
    assert val(vm, "specedge_queue_wait_seconds_count", tenant="beta") == 1

    vm.on_frame("alpha", VerifyFrame(10, [1], [-1], draft_ms=8.0, rtt_ms=40.0, depth=5))
    vm.on_frame("alpha", VerifyFrame(10, [1], [-1]))  # nothing measured yet: not observed
    assert val(vm, "specedge_edge_reported_rtt_seconds_sum", tenant="alpha") == pytest.approx(0.04)
    assert val(vm, "specedge_edge_reported_draft_forward_seconds_count", tenant="alpha") == 1
    assert val(vm, "specedge_edge_reported_draft_depth_sum", tenant="alpha") == 5
    assert EdgeTelemetry.of("t", VerifyFrame(1, [], [], 1.5, 2.5, 3)) == EdgeTelemetry("t", 1.5, 2.5, 3)

    vm.on_open("alpha", "gone", 5)
    vm.on_evict("gone", "idle_timeout")
    assert "gone" not in vm._last_reply
    assert val(vm, "specedge_evictions_total", reason="idle_timeout") == 1


def test_state_gauges_cover_idle_tenants_and_hints(vm):
    vm.record_state(VerifierState({"alpha": 3, "gamma": 1}, kv_tokens=900, kv_capacity=4096, pending=2,
                                  cost_fixed_s=0.01, cost_per_token_s=0.001))
    assert val(vm, "specedge_open_sessions", tenant="alpha") == 3
    assert val(vm, "specedge_open_sessions", tenant="beta") == 0  # configured, idle: an explicit zero
    assert val(vm, "specedge_open_sessions", tenant="gamma") == 1
    assert val(vm, "specedge_kv_tokens_in_use") == 900
    assert val(vm, "specedge_kv_tokens_capacity") == 4096
    assert val(vm, "specedge_pending_requests") == 2
    assert not val(vm, "specedge_pacing_depth_hint")  # no round since the last update: not set
    for d in (4, 6):
        req, res = tree_round([5], [-1], [0], bonus=1)
        vm.on_round("alpha", f"s{d}", req, res, depth_hint=d, budget_hint=16)
    vm.record_state(VerifierState({}, 0, 4096, 0, 0.0, 0.0))
    assert val(vm, "specedge_pacing_depth_hint") == 5
    assert val(vm, "specedge_pacing_budget_hint") == 16
    assert val(vm, "specedge_open_sessions", tenant="alpha") == 0


def test_refresh_reads_a_real_verifier_core_and_throttles():
    import asyncio

    from deploy.config import AppConfig
    from deploy.verifier.server import VerifierServer

    cfg = AppConfig(target={"model": "tiny-random", "dtype": "float32"}, verifier={"kv_budget_tokens": 1000})
    core = VerifierServer(cfg)
    assert isinstance(core.metrics.exporter, PrometheusClientExporter)  # outside Serve: in-process registry

    async def main():
        return await core.open_session("dev", {"prompt_ids": [5, 6, 7, 8]})

    status, payload = asyncio.run(main())
    assert status == 200
    st = core.metrics.refresh(core, force=True)
    assert st.sessions_by_tenant == {"dev": 1} and st.kv_capacity == 1000 and st.kv_tokens == 4
    assert core.metrics.refresh(core) is None  # within refresh_s of the last update
    m = core.metrics
    assert val(m, "specedge_open_sessions", tenant="dev") == 1
    assert val(m, "specedge_sessions_opened_total", tenant="dev") == 1
    assert val(m, "specedge_verify_batch_sessions_count", kind="prefill") == 1


def test_router_metrics_errors_and_shedding():
    rm = RouterMetrics(PrometheusClientExporter(specs_for("router")))
    rm.on_error(Overloaded("busy", reason="queue_full"))
    rm.on_error(Overloaded("busy", reason="tenant_rate"))
    rm.on_error(InvalidRequest("bad"))
    rm.on_error(SessionEvicted("gone"))
    rm.on_verify("alpha", 0.012, inflight=3)
    r = rm.exporter.registry
    assert r.get_sample_value("specedge_router_shed_requests_total", {"reason": "queue_full"}) == 1
    assert r.get_sample_value("specedge_router_shed_requests_total", {"reason": "tenant_rate"}) == 1
    assert r.get_sample_value("specedge_router_errors_total", {"status": "429", "code": "overloaded"}) == 2
    assert r.get_sample_value("specedge_router_errors_total", {"status": "410", "code": "session_evicted"}) == 1
    assert r.get_sample_value("specedge_router_verify_latency_seconds_count", {"tenant": "alpha"}) == 1
    assert r.get_sample_value("specedge_router_inflight_requests", {}) == 3


def test_metrics_never_break_serving(vm, caplog):
    vm.on_round("alpha", "s1", object(), object())  # garbage in: logged once, no exception
    vm.on_forward(None)
    assert any("metrics:" in r.message for r in caplog.records)


def test_edge_metrics_observe_and_serve():
    st = GenerationStats(tokens=40, seconds=2.0, ttft_s=0.1, rounds=10, draft_tokens=200, accepted_tokens=25,
                         draft_forwards=30, proactive_forwards=12, align_attempts=8, aligned=3, reused_tokens=5,
                         reopens=1, overload_waits=2, depth_sum=40, rtt_ms=[20.0, 30.0],
                         round_ms=[50.0] * 10, draft_ms=[5.0] * 42, finish_reason="length")
    em = EdgeMetrics()
    em.observe(st)
    em.observe(st)
    r = em.registry
    assert r.get_sample_value("specedge_edge_spec_decode_num_drafts_total") == 20
    assert r.get_sample_value("specedge_edge_spec_decode_num_accepted_tokens_total") == 50
    assert r.get_sample_value("specedge_edge_generations_total", {"finish_reason": "length"}) == 2
    assert r.get_sample_value("specedge_edge_draft_forwards_total", {"kind": "proactive"}) == 24
    assert r.get_sample_value("specedge_edge_draft_forward_seconds_count") == 84
    assert r.get_sample_value("specedge_edge_rtt_seconds_sum") == pytest.approx(0.1)
    assert r.get_sample_value("specedge_edge_mean_draft_depth") == 4
    port = em.serve(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        em.close()
    assert "specedge_edge_round_latency_seconds_bucket" in body
    assert "specedge_edge_generated_tokens_total 80.0" in body


def test_vllm_request_metrics_ttft_e2e_tokens_and_finish(vm):
    clock = vm.clock
    vm.on_arrival("s1")
    clock.t += 0.25
    vm.on_open("alpha", "s1", prefix_len=12, first_token=True)
    clock.t += 1.0
    req, res = tree_round([5, 6], [-1, 0], [0, 1], bonus=4)
    vm.on_round("alpha", "s1", req, res)
    clock.t += 0.5
    req, res = tree_round([5], [-1], [], bonus=4, finished=True)
    vm.on_round("alpha", "s1", req, res)
    assert val(vm, "specedge_time_to_first_token_seconds_sum", tenant="alpha") == pytest.approx(0.25)
    assert val(vm, "specedge_e2e_request_latency_seconds_sum", tenant="alpha") == pytest.approx(1.75)
    assert val(vm, "specedge_prompt_tokens_total", tenant="alpha") == 11
    assert val(vm, "specedge_generation_tokens_total", tenant="alpha") == 1 + 3 + 1
    assert val(vm, "specedge_request_success_total", tenant="alpha", finished_reason="stop") == 1
    assert "s1" not in vm._arrived
    # a re-open (no first token) is no new request; one finished by its first token ends at its open
    vm.on_arrival("r")
    vm.on_open("beta", "r", prefix_len=30)
    vm.on_arrival("one")
    clock.t += 0.1
    vm.on_open("beta", "one", prefix_len=5, first_token=True, finish_reason="length")
    assert val(vm, "specedge_time_to_first_token_seconds_count", tenant="beta") == 1
    assert val(vm, "specedge_e2e_request_latency_seconds_sum", tenant="beta") == pytest.approx(0.1)
    assert val(vm, "specedge_request_success_total", tenant="beta", finished_reason="length") == 1
    assert val(vm, "specedge_prompt_tokens_total", tenant="beta") == 4
    vm.on_arrival("gone")
    vm.on_evict("gone", "idle_timeout")
    assert not vm._arrived


def test_requests_running_and_waiting_gauges(vm):
    vm.record_state(VerifierState({"alpha": 3, "beta": 1}, 0, 4096, 0, 0.0, 0.0, waiting=2))
    assert val(vm, "specedge_num_requests_running") == 4 and val(vm, "specedge_num_requests_waiting") == 2


def test_a_real_verifier_core_counts_a_request_from_open_to_finish():
    import asyncio

    from deploy.config import AppConfig
    from specdec.protocol import ReplyFrame, VerifyFrame as Frame
    from deploy.verifier.server import VerifierServer

    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"}))

    async def main():
        _, opened = await core.open_session("dev", {"prompt_ids": [5, 6, 7, 8], "sampling": {"max_tokens": 3, "ignore_eos": True}})
        prefix, finished = opened["prefix_len"], opened["finished"]
        while not finished:
            _, reply = await core.verify(opened["session_id"], "dev", Frame(prefix, [9], [-1]).encode())
            reply = ReplyFrame.decode(reply)
            prefix, finished = reply.prefix_len, reply.finished

    asyncio.run(main())
    m = core.metrics
    assert val(m, "specedge_time_to_first_token_seconds_count", tenant="dev") == 1
    assert val(m, "specedge_e2e_request_latency_seconds_count", tenant="dev") == 1
    assert val(m, "specedge_generation_tokens_total", tenant="dev") == 3
    assert val(m, "specedge_prompt_tokens_total", tenant="dev") == 4
    core.metrics.refresh(core, force=True)
    assert val(m, "specedge_num_requests_waiting") == 0
