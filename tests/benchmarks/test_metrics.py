"""ITL samples/percentiles, SpecEdge's cost efficiency, a configuration's figures and their pooling."""

import math
from dataclasses import replace

import pytest

from benchmarks.metrics import (Window, aggregate, cost_efficiency_ktok_per_usd, itl_samples, pool_roles,
                                pool_windows, row, weighted_mean, weighted_percentile)


def test_itl_batch_of_n_tokens_counts_n_samples_of_gap_over_n():
    arrivals = [(0.0, 1), (0.1, 1), (0.4, 3), (0.5, 1)]
    s = itl_samples(arrivals)
    assert s == [(pytest.approx(0.1), 1.0), (pytest.approx(0.1), 3.0), (pytest.approx(0.1), 1.0)]
    # the mean is the time per output token after the first
    assert weighted_mean(s) == pytest.approx(0.5 / 5)


def test_weighted_percentiles():
    s = [(1.0, 98.0), (10.0, 1.0), (100.0, 1.0)]
    assert weighted_percentile(s, 50) == 1.0
    assert weighted_percentile(s, 99) == 10.0
    assert weighted_percentile(s, 100) == 100.0
    assert math.isnan(weighted_percentile([], 50))


def test_cost_efficiency_reproduces_specedge_table_1():
    # Math row: server-only 32.84 tok/s -> 29.19 ktok/$; SpecEdge 72.93 tok/s with 2 edge GPUs -> 55.28
    assert cost_efficiency_ktok_per_usd(32.84, 0) == pytest.approx(29.19, abs=0.01)
    assert cost_efficiency_ktok_per_usd(72.93, 2) == pytest.approx(55.28, abs=0.01)


def test_row_counts_server_draft_time_as_server_cost():
    w = Window(wall_s=10.0, verifier_busy_s=2.0, server_draft_cpu_s=2.0, tokens_emitted=100, up_bytes=1000,
               down_bytes=500)
    r = row("server_sd", 15.0, 1, w, {"tokens": 100, "itl": [(0.1, 99.0)], "tokens_per_verify": 2.0}, 0)
    assert r["server_tokens_per_busy_s"] == pytest.approx(25.0)
    assert r["server_tokens_per_s"] == pytest.approx(10.0)
    assert r["verifier_utilisation"] == pytest.approx(0.2)
    assert r["uplink_bytes_per_token"] == 10 and r["downlink_bytes_per_token"] == 5
    assert r["itl_ms_mean"] == pytest.approx(100.0)


def test_row_splits_the_server_cpu_into_forwards_request_path_and_background():
    w = Window(wall_s=10.0, verifier_busy_s=6.0, server_draft_cpu_s=0.0, tokens_emitted=200, up_bytes=0,
               down_bytes=0, verifier_cpu_s=7.0, server_cpu_s=10.0, forward_cpu_s_prefill=1.0,
               forward_cpu_s_verify=4.0)
    by_role = {"verifier": 7.0, "router": 1.5, "proxy": 0.5, "controller": 0.6, "raylet": 0.4}
    r = row("edge_full", 15.0, 4, w, {"tokens": 200}, 4, by_role=by_role)
    ms = {k: r[f"cpu_ms_per_token_{k}"] for k in ("forward", "verifier_other", "router", "proxy", "background")}
    assert ms == pytest.approx({"forward": 25.0, "verifier_other": 10.0, "router": 7.5, "proxy": 2.5,
                                "background": 5.0})
    assert sum(ms.values()) == pytest.approx(1e3 * w.server_cpu_s / 200)  # the parts add up to the whole server
    assert r["tokens_per_forward_cpu_s"] == pytest.approx(40.0)
    assert math.isnan(r["verify_forward_cpu_ms"])  # no verify forwards counted: no per-forward cost
    # the live row-cost curve: 80 verify forwards of 4 s in all, 200 tokens, prefill 1 s
    f = row("edge_full", 15.0, 4, replace(w, verify_forwards=80, verify_rows=240), {"tokens": 200}, 4, by_role=by_role)
    assert f["verify_forward_cpu_ms"] == pytest.approx(50.0) and f["rows_per_forward"] == pytest.approx(3.0)
    assert f["verify_forwards_per_token"] == pytest.approx(0.4) and f["prefill_cpu_ms_per_token"] == pytest.approx(5.0)
    # prompt tokens the replica computed, per generation: the same prompts must cost every mode the same
    g = row("edge_full", 15.0, 4, replace(w, prefill_tokens=364), {"tokens": 200, "generations": 4}, 4)
    assert g["prefill_tokens_per_generation"] == pytest.approx(91.0)
    assert math.isnan(f["prefill_tokens_per_generation"])  # no generations counted
    # forward CPU per token = verify forwards per token x their cost + prefill per token
    assert f["cpu_ms_per_token_forward"] == pytest.approx(
        f["verify_forwards_per_token"] * f["verify_forward_cpu_ms"] + f["prefill_cpu_ms_per_token"])
    # topology colocated: the router replica holds the verifier; its other work is "verifier_other"
    colo = {"router": 8.5, "proxy": 0.5, "controller": 0.6, "raylet": 0.4}
    c = row("edge_full", 15.0, 4, w, {"tokens": 200}, 4, by_role=colo)
    cms = {k: c[f"cpu_ms_per_token_{k}"] for k in ("forward", "verifier_other", "router", "proxy", "background")}
    assert cms == pytest.approx({"forward": 25.0, "verifier_other": 17.5, "router": 0.0, "proxy": 2.5,
                                 "background": 5.0})
    # a server with no forward clock (vLLM) or an older server: no split, not a wrong one
    peer = Window(wall_s=10.0, verifier_busy_s=float("nan"), server_draft_cpu_s=0.0, tokens_emitted=200, up_bytes=0,
                  down_bytes=0, verifier_cpu_s=5.0, server_cpu_s=5.5)
    p = row("vllm_ar", 15.0, 4, peer, {"tokens": 200}, 0, by_role={"vllm_worker": 5.0, "api_server": 0.5})
    assert math.isnan(p["cpu_ms_per_token_forward"]) and math.isnan(p["tokens_per_forward_cpu_s"])


def _gen(tokens, rounds, accepted, nodes, aligned, attempts):
    return {"tokens": tokens, "seconds": 2.0, "ttft_s": 0.1, "arrivals": [(0.0, 1), (0.5, 3), (1.0, tokens - 4)],
            "rounds": rounds, "draft_tokens": nodes, "accepted": accepted, "aligned": aligned,
            "align_attempts": attempts, "depth_sum": 3 * rounds, "draft_forwards": 2 * rounds,
            "proactive_forwards": 5, "draft_ms": [4.0, 6.0], "rtt_ms": [15.0], "reopens": 0,
            "verified_nodes": nodes // 2, "confidence": True}


def test_aggregate_edge_generations():
    gens = [_gen(9, 2, 6, 40, 1, 2), _gen(9, 4, 4, 80, 0, 2)]
    a = aggregate(gens, "edge_proactive", wall_s=4.0, depth=3)
    assert a["tokens"] == 18 and a["generations"] == 2
    assert a["tokens_per_verify"] == pytest.approx((18 - 2) / 6)  # opening tokens come with the prefill
    assert a["alignment_rate"] == pytest.approx(0.25)
    assert a["depth_mean"] == pytest.approx(3.0) and a["draft_ms_mean"] == pytest.approx(5.0)
    assert a["up_payload_bytes"] == 20 * 6 + 7 * 120 and a["down_payload_bytes"] == 24 * 6 + 2 * 10
    assert a["sent_nodes_per_round"] == pytest.approx(20) and a["verified_nodes_per_round"] == pytest.approx(10)
    assert sum(w for _, w in a["itl"]) == pytest.approx(16)  # every token after the first is a sample


def test_pooled_windows_are_totals_so_a_pooled_ratio_weighs_each_repeat_by_its_size():
    a = Window(wall_s=2.0, verifier_busy_s=1.0, server_draft_cpu_s=0.0, tokens_emitted=100, up_bytes=10,
               down_bytes=20, verifier_cpu_s=1.5, server_cpu_s=2.0, verify_forwards=50, verify_sessions=100,
               forward_cpu_s_prefill=0.1, forward_cpu_s_verify=0.8)
    b = Window(wall_s=4.0, verifier_busy_s=3.0, server_draft_cpu_s=0.0, tokens_emitted=300, up_bytes=30,
               down_bytes=40, verifier_cpu_s=3.5, server_cpu_s=4.0, verify_forwards=100, verify_sessions=100,
               forward_cpu_s_prefill=0.2, forward_cpu_s_verify=2.5)
    w = pool_windows([a, b])
    assert (w.wall_s, w.tokens_emitted, w.server_cpu_s, w.verify_forwards) == (6.0, 400, 6.0, 150)
    r = row("server_ar", 15.0, 2, w, {"tokens": 400}, 0)
    assert r["tokens_per_server_cpu_s"] == pytest.approx(400 / 6.0)  # not the mean of 50 and 75
    assert r["sessions_per_forward"] == pytest.approx(200 / 150)
    assert pool_windows([a]) == a
    assert pool_roles([{"router": 1.0, "proxy": 0.5}, {"router": 2.0, "raylet": 0.1}]) == pytest.approx(
        {"router": 3.0, "proxy": 0.5, "raylet": 0.1})


def test_aggregating_two_repeats_generations_is_their_pool():
    one, two = [_gen(9, 2, 6, 40, 1, 2)], [_gen(9, 4, 4, 40, 0, 2)]
    a = aggregate(one + two, "edge_full", wall_s=4.0, depth=3)
    assert a["tokens"] == 18 and a["generations"] == 2 and a["wall_s"] == 4.0
    assert a["sent_nodes_per_round"] == pytest.approx(80 / 6)  # rounds pooled, not the mean of 20 and 10
    each = [aggregate(g, "edge_full", 2.0, 3) for g in (one, two)]
    assert len(a["itl"]) == sum(len(e["itl"]) for e in each)
