"""sim/validate.py: a small case of the validation in make test: the committed measured runs of
edge-drafted decoding at 16 sessions (RTT 15 ms, a row the host's CPU was not fitted to) and its
prediction from the profile measured beside them, on the figures the full validation finds within
target; deterministic (virtual time), so the error is the same on any machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.validate import HERE, RUNS, TARGETS, bench_case, fit_alpha, measured, merge_runs, predicted
from loadtests.synthetic_tree import AcceptanceModel, expected_accepted


def test_the_edge_drafted_16_session_run_is_predicted_within_its_targets():
    from sim.__main__ import simulate
    from sim.cost_profile import CostProfile
    from sim.validate import bench_fit_rows, host_from_bench

    runs = merge_runs([HERE / f for f in RUNS])
    row = next(r for r in runs["rows"] if r["mode"] == "edge_full" and r["sessions"] == 16)
    assert all(row is not r for r in bench_fit_rows(runs["rows"]))  # held out
    app, workload = bench_case(row, {**runs["conditions"], "rows": runs["rows"]})
    out = simulate(app, CostProfile.load(HERE / "verify-step-cpu.json"), workload, 0, host_from_bench(runs))
    m, p = measured(row), predicted(out)
    for fig in ("verified_tokens_per_s", "verify_rounds_per_s", "latency_ms_p50"):  # its p99: a reported miss
        assert abs(p[fig] / m[fig] - 1) <= TARGETS[fig], (fig, m, p)
    assert out["diverged_rounds"] == 0 and out["generations"] * row["repeats"] == row["generations"]


def test_a_benchmark_row_is_simulated_with_the_runs_own_prompt_lengths():
    """benchmarks.run's prompts (MT-Bench and HumanEval through the embedded tokenizer's chat
    template), as many as it dealt the row's sessions: their lengths, not an assumed range."""
    import dataclasses

    from benchmarks.run_plan import PLANS, prompt_ids

    runs = merge_runs([HERE / f for f in RUNS])
    for row in runs["rows"]:
        _, workload = bench_case(row, {**runs["conditions"], "rows": runs["rows"]})
        plan = dataclasses.replace(PLANS["full"])
        ids = prompt_ids(plan, plan.prompts_for(row["sessions"]))[0]
        assert workload.prompt_lengths == [len(x) for x in ids]
        assert len(ids) * row["repeats"] == row["generations"]


@pytest.mark.parametrize("target", [1.5, 1.7, 2.2])
def test_the_fitted_acceptance_gives_the_measured_tokens_per_round(target):
    alpha = fit_alpha(target, 2, 5, 0.3)
    assert 1 + expected_accepted(AcceptanceModel(alpha, 0.3), 2, budget=5) == pytest.approx(target, abs=1e-6)


def test_the_hosts_cpu_per_request_measured_at_300_users_holds_at_1000_and_3000():
    """host_from_loadtest: the router's and the replica's CPU per request are a property of the host
    and the code, not of the load: the three committed cases (three runs each, merged, 2026-12-02)
    agree within 25 % (the replica's per request that reaches it, 11 % apart; the router's per
    request, 14 %: a 429, 12 % of the 300-user runs' requests and 17-25 % of the others', costs it
    less than a round; the background's steady part, 13 %; its bursts 27 %, within 30 %). Locust's own grows with
    its users (its idle ones cost it too): 38 % more a request at 3,000 users than at 300. The served
    system keeps most of the host's 2 cores busy, not all."""
    from sim.validate import host_from_loadtest

    hosts = [host_from_loadtest(json.loads((HERE / "loadtests" / f"ramp-{n}.json").read_text()))
             for n in (300, 1000, 3000)]
    for field, apart in (("router_s", 1.25), ("replica_s", 1.25), ("background_cores", 1.25), ("burst_cores", 1.3),
                         ("client_s", 1.45)):
        values = [getattr(h, field) for h in hosts]
        assert max(values) <= apart * min(values) and min(values) > 0, (field, values)
    assert all(9.5 < h.burst_every_s < 10.5 and 0.8 < h.burst_s < 1.6 for h in hosts)  # Ray's agent, every 10 s
    assert all(1.7 <= h.cores < 1.95 and h.shared_cores == pytest.approx(h.cores - h.background_cores) for h in hosts)


def test_a_client_in_a_session_of_its_own_claims_the_cores_by_its_nice():
    from sim.validate import client_weight

    assert client_weight({"client_niceness": -5, "client_autogroup": True}) == pytest.approx(3.05, rel=0.01)
    assert client_weight({"client_niceness": -5, "client_autogroup": False}) == 1.0  # its nice ranks it in no group
    assert client_weight({"client_niceness": 0}) == client_weight({}) == 1.0


def test_the_replicas_cpu_per_request_forward_and_tree_fits_the_run_and_predicts_its_held_out_rows():
    """host_from_bench: fitted on server_ar x 1 and x 16 and edge_full x 1 of the committed run, it
    gives back their CPU per token outside the model, and predicts the other rows' within 20 % (the
    committed runs: 11 % and 17 % at 4 sessions, 16 % at `edge_full` x 16)."""
    from sim.validate import bench_fit_rows, host_from_bench

    run = merge_runs([HERE / f for f in RUNS])
    h = host_from_bench(run)
    assert h.replica_s > 0 and h.forward_s > 0 and h.replica_tree_s > 0 and 0 < h.background_cores < 0.2
    bursty = host_from_bench({**run, "conditions": {**run["conditions"], "background_bursts": {
        "cores": 0.5, "length_s": 1.0, "every_s": 10.0}}})  # the bursts' mean comes out of the steady part
    assert (bursty.burst_cores, bursty.burst_s, bursty.burst_every_s) == (0.5, 1.0, 10.0)
    assert bursty.background_cores == pytest.approx(max(0.0, h.background_cores - 0.05))

    def per_token_ms(r):
        tree = h.replica_tree_s if r["mode"] == "edge_full" else 0.0
        return 1e3 * ((h.replica_s + tree) / r["tokens_per_verify"] + h.forward_s * r["verify_forwards_per_token"])

    fit = bench_fit_rows(run["rows"])
    for r in run["rows"]:
        err = per_token_ms(r) / r["cpu_ms_per_token_verifier_other"] - 1
        assert abs(err) <= (1e-9 if any(r is f for f in fit) else 0.20), (r["mode"], r["sessions"], err)


def test_the_replicas_cpu_per_request_is_its_cpu_less_its_forwards_cpu_over_the_requests_reaching_it():
    """host_from_loadtest: a 429 never reaches the replica, and a forward's wall (waiting for a core
    included) is not its CPU; a run without the forwards' CPU falls back to their wall, one without
    Locust's own CPU gives the client the rest of the cores."""
    from sim.validate import ASSUMED, host_from_loadtest, router_shares

    summary = {"machine": {"cores": 2}, "verify_per_s_window": 800.0, "rate_429_window": 0.2,
               "sessions": {"opened": 600, "closed_by_server": 200}, "run": {"duration_s": 50.0},
               "server": {"cores_by_role": {"router": 0.7, "verifier": 0.7, "gcs": 0.1},
                          "busy_fraction": 0.25, "forward_cpu_cores": 0.1}}
    h = host_from_loadtest({"summary": summary})
    sessions_per_s = (2 * 600 - 200) / 50.0
    assert h.replica_s == pytest.approx((0.7 - 0.1) / (800.0 + sessions_per_s))
    # the router answers the 429s too, each at the share of its CPU the simulation charges one (its admission's,
    # as the served router's profile splits it: sim/validation/router-phases.json)
    shed = 800.0 / 0.8 - 800.0
    shares = router_shares()
    before = (1 - shares["reply_share"]) * shares["admit_share"]
    assert (h.reply_share, h.admit_share) == (shares["reply_share"], shares["admit_share"])
    assert h.router_parts_s[0] / h.router_s == pytest.approx(before)
    assert h.router_s * (800.0 + sessions_per_s + before * shed) == pytest.approx(0.7)
    # the client's reply share is its own (assumed), not the router's measured one
    assert h.client_parts_s[1] == pytest.approx(ASSUMED["client_reply_share"] * h.client_s)
    assert h.client_s == pytest.approx((2.0 - 0.7 - 0.7 - 0.1) / (800.0 / 0.8 + sessions_per_s)) and h.cores == 2.0
    del summary["server"]["forward_cpu_cores"]
    assert host_from_loadtest({"summary": summary}).replica_s == pytest.approx((0.7 - 0.25) / (800.0 + sessions_per_s))
    # Locust's own CPU measured, and the host's idle left to no one (the cores the served system keeps busy)
    summary.update(locust_cores_window=0.3)
    summary["server"]["host_cores"] = {"user": 1.5, "system": 0.3, "idle": 0.19, "iowait": 0.01}
    h = host_from_loadtest({"summary": summary})
    assert h.client_s == pytest.approx(0.3 / (800.0 / 0.8 + sessions_per_s)) and h.cores == pytest.approx(1.8)
    assert h.burst_cores == 0.0 and h.background_cores == pytest.approx(0.1)  # a run without bursts measured
    # the background's bursts measured (benchmarks/bursts.py): the rest of its CPU is its steady part
    summary["server"]["background_bursts"] = {"cores": 0.8, "length_s": 1.0, "every_s": 10.0}
    h = host_from_loadtest({"summary": summary})
    assert (h.burst_cores, h.burst_s, h.burst_every_s) == (0.8, 1.0, 10.0)
    assert h.background_cores == pytest.approx(0.1 - 0.08)


def test_a_figure_is_predicted_as_its_mean_over_the_seeds_with_their_spread():
    from sim.validate import _compare

    m = {"verified_tokens_per_s": 100.0, "verify_rounds_per_s": 50.0, "latency_ms_p50": 10.0, "latency_ms_p99": 20.0}
    runs = [{**m, "verified_tokens_per_s": 90.0}, {**m, "verified_tokens_per_s": 130.0}]
    rows = {r["figure"]: r for r in _compare("case", m, runs)}
    tps = rows["verified_tokens_per_s"]
    assert tps["predicted"] == 110.0 and tps["error"] == pytest.approx(0.10) and tps["ok"]
    assert tps["seed_spread"] == pytest.approx(20.0 / 110.0) and tps["seeds"] == 2
    assert rows["latency_ms_p99"]["seed_spread"] == 0.0 and rows["latency_ms_p99"]["error"] == 0.0


def test_runs_of_one_command_merge_into_their_mean_with_their_spread(tmp_path):
    row = {"mode": "server_ar", "rtt_ms": 15.0, "sessions": 4, "generations": 12, "server_tokens_per_s": 100.0,
           "tokens_per_verify": 1.0, "itl_ms_p50": 10.0, "itl_ms_p99": 20.0, "warm": True}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"conditions": {"run": "a"}, "rows": [row]}))
    b.write_text(json.dumps({"conditions": {"run": "b"}, "rows": [{**row, "server_tokens_per_s": 300.0}]}))
    merged = merge_runs([a, b])
    m = merged["rows"][0]
    assert m["server_tokens_per_s"] == 200.0 and m["sessions"] == 4 and m["warm"] is True
    assert m["spread"]["verified_tokens_per_s"] == pytest.approx(1.0) and m["spread"]["latency_ms_p99"] == 0.0
    assert merged["conditions"]["runs"] == ["a", "b"] and merged["conditions"]["background_bursts"] is None
    # the server's background bursts (benchmarks/bursts.py): their mean over the runs that measured them
    bursts = {"cores": 0.6, "length_s": 1.0, "every_s": 10.0, "steady_cores": 0.02, "bursts": 5, "window_s": 50.0}
    a.write_text(json.dumps({"conditions": {"run": "a", "background_bursts": bursts}, "rows": [row]}))
    b.write_text(json.dumps({"conditions": {"run": "b", "background_bursts": {**bursts, "cores": 0.8}}, "rows": [row]}))
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"conditions": {"run": "c"}, "rows": [row]}))  # an older run: none
    assert merge_runs([a, b, c])["conditions"]["background_bursts"] == {"cores": 0.7, "length_s": 1.0, "every_s": 10.0}
    b.write_text(json.dumps({"conditions": {"run": "b"}, "rows": [{**row, "sessions": 16}]}))
    with pytest.raises(ValueError, match="same command"):
        merge_runs([a, b])


def test_load_tests_of_one_command_merge_into_their_mean_with_their_spread(tmp_path):
    """Load tests on a shared 2-core host read 2,191-2,503 tokens/s in three runs of one command:
    the summaries of several runs merge as a benchmark's rows do, and a run of another command is
    refused."""
    from sim.validate import loadtest_measured, record_loadtest

    def run(name: str, tokens: float, users: int = 300) -> Path:
        d = tmp_path / name
        d.mkdir()
        summary = {"run": {"users": users, "host": f"http://127.0.0.1:{len(name)}"}, "window_s": [8.0, 57.0],
                   "tokens_per_s_window": tokens, "verify_per_s_window": tokens / 2, "rate_429_window": 0.1,
                   "verify_ms_window": {"p50": 60.0, "p99": 200.0}, "sessions": {"opened": 100.0},
                   "verify_outside_router_ms_window": {"n": 9, "p50": 10.0, "p99": tokens / 10, "max": 300.0},
                   "server": {"cores_by_role": {"router": 0.7}, "busy_fraction": 0.2, "other": 1}}
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "loadtest_config.json").write_text(json.dumps({"app": {"users": users}, "user": {"rtt_ms": 40.0},
                                                            "workload": {"prompt_len": [8, 48]}}))
        return d

    dest = tmp_path / "ramp-300.json"
    record_loadtest([run("a", 1000.0), run("bb", 1200.0), run("ccc", 1100.0)], dest)
    s = json.loads(dest.read_text())["summary"]
    assert s["tokens_per_s_window"] == pytest.approx(1100.0) and s["verify_per_s_window"] == pytest.approx(550.0)
    assert s["run"] == {"users": 300, "host": "http://127.0.0.1:1"} and s["runs"] == 3
    assert s["verify_ms_window"]["p50"] == 60.0 and "other" not in s["server"]
    assert s["spread"]["verified_tokens_per_s"] == pytest.approx(200.0 / 1100.0)
    assert s["spread"]["latency_ms_p99"] == 0.0
    assert loadtest_measured(s)["outside_ms_p99"] == pytest.approx(110.0)  # the users' time outside the router
    assert s["spread"]["outside_ms_p99"] == pytest.approx(20.0 / 110.0)
    with pytest.raises(ValueError, match="one command"):
        record_loadtest([run("d", 1000.0), run("e", 1000.0, users=1000)], dest)


def test_the_routers_shares_are_the_committed_profiles_of_the_served_router():
    """router_shares: HostCost.reply_share and admit_share are read from the served router's
    measured profile (benchmarks.router_phases), its counts and its shares agreeing."""
    from benchmarks.router_phases import RouterPhases
    from sim.validate import ROUTER_PHASES, router_shares

    d = json.loads(ROUTER_PHASES.read_text())
    ph = RouterPhases(d["counts"])
    assert router_shares() == {"reply_share": d["reply_share"], "admit_share": d["admit_share"]}
    assert (ph.reply_share, ph.admit_share) == (pytest.approx(d["reply_share"], abs=1e-4),
                                                pytest.approx(d["admit_share"], abs=1e-4))
    assert 0 < d["reply_share"] < 1 and 0 < d["admit_share"] < 1
