"""ITL samples/percentiles and SpecEdge's cost efficiency."""

import math

import pytest

from benchmarks.metrics import (Window, cost_efficiency_ktok_per_usd, itl_samples, row, weighted_mean,
                                weighted_percentile)


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
