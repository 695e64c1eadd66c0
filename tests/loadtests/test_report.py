"""Report arithmetic and checks on hand-made Locust output (no Locust, no Ray)."""

from __future__ import annotations

import argparse
import json

import pytest

from loadtests.config import LoadTestConfig, scenario
from loadtests.report import held, markdown, merge_counters, percentile, steady_window, summarize
from loadtests.run import parse_duration

T0 = 1_000_000.0


def test_percentile_nearest_rank():
    v = list(range(1, 101))
    assert percentile(v, 50) == 50
    assert percentile(v, 99) == 99
    assert percentile(v, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) != percentile([], 50)  # NaN


@pytest.mark.parametrize("text,seconds", [("60s", 60), ("2m", 120), ("1m30s", 90), ("45", 45), ("1h", 3600)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["abc", "10x", "5m3"])
def test_parse_duration_rejects(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(bad)


def test_steady_window_starts_after_spawn_and_warmup():
    hist = [{"Name": "Aggregated", "Timestamp": str(int(T0) + i), "User Count": str(min(10 * i, 40))}
            for i in range(20)]
    lo, hi = steady_window(hist, 40, 2.0, (0, 0))
    assert lo == T0 + 4 + 2.0 and hi == T0 + 19 - 2.0
    assert steady_window([], 40, 2.0, (1.0, 2.0)) == (1.0, 2.0)


def _counters(path, tenants: dict[str, dict], per_second: dict[str, int]):
    fields = {"generations": 10, "finished": 10, "opens": 10, "reopens": 0, "closes": 10, "superseded": 0,
              "verifies": 100, "tokens": 300, "accepted": 200, "drafted": 1600, "hits": 200, "expected": 210.0,
              "accept_mismatch": 0, "diverged": 0, "shed": 0, "unavailable": 0, "errors": 0, "unclosed": 0}
    data = {"pid": 1, "tenants": {t: {**fields, **over} for t, over in tenants.items()}, "shed_reasons": {},
            "error_kinds": {}, "tokens_by_second": {str(int(T0) + s): dict(per_second) for s in range(5, 30)},
            "verify_ms": {t: [10.0] * 50 + [900.0] for t in tenants},
            "verify_at": {t: [T0 + 10] * 51 for t in tenants}, "shed_ms": []}
    path.write_text(json.dumps(data))


def _meta():
    return {"users": 40, "spawn_rate": 40, "duration_s": 30, "processes": 1, "host": "http://x",
            "started_app": False, "locust_started": T0, "locust_ended": T0 + 30, "kill_sent_at": None}


def test_fair_shares_pass_and_unfair_shares_fail(tmp_path):
    cfg = scenario("smoke")
    _counters(tmp_path / "counters.json", {"gold": {}, "bronze": {}}, {"gold": 75, "bronze": 25})
    s = summarize(tmp_path, cfg, _meta(), None)
    assert s["tenants"]["gold"]["token_share"] == pytest.approx(0.75)
    assert s["tenants"]["bronze"]["share_over_weight"] == pytest.approx(1.0)
    assert all(c["ok"] for c in s["checks"]), s["checks"]
    assert s["verify_ms_window"]["p99"] == 900.0 and s["verify_ms_window"]["p50"] == 10.0

    _counters(tmp_path / "counters.json", {"gold": {}, "bronze": {}}, {"gold": 50, "bronze": 50})
    s = summarize(tmp_path, cfg, _meta(), None)
    bad = [c["name"] for c in s["checks"] if not c["ok"]]
    assert bad == ["per-tenant token share within 20% of weight share"]


def test_errors_and_unclosed_sessions_fail_the_checks(tmp_path):
    cfg = LoadTestConfig(name="x", app=scenario("ramp").app)
    _counters(tmp_path / "counters.json", {"default": {"closes": 9, "errors": 1}}, {"default": 10})
    s = summarize(tmp_path, cfg, _meta(), None)
    failed = {c["name"] for c in s["checks"] if not c["ok"]}
    assert failed == {"no errors other than 429", "every session closed"}
    assert s["sessions"]["unclosed"] == 1
    assert not held(s)


def test_counters_of_several_processes_add_up(tmp_path):
    _counters(tmp_path / "a.json", {"default": {}}, {"default": 3})
    _counters(tmp_path / "b.json", {"default": {"tokens": 5}}, {"default": 4})
    m = merge_counters([tmp_path / "a.json", tmp_path / "b.json"])
    assert m["processes"] == 2
    assert m["tenants"]["default"]["tokens"] == 305
    assert m["tokens_by_second"][int(T0) + 5]["default"] == 7
    assert len(m["verify_ms"]["default"]) == 102


def test_the_users_take_keys_from_the_app_config():
    cfg = scenario("tenants")
    keys = cfg.tenant_keys()
    from deploy.config import hash_api_key

    hashed = {t.name: t.api_key_sha256 for t in cfg.app_config().router.load_tenants()}
    assert {n: hash_api_key(k) for n, k in keys.items()} == hashed
    assert cfg.tenant_weights() == {"gold": 3.0, "bronze": 1.0}
    with pytest.raises(ValueError):
        LoadTestConfig(app={"router": {"tenants": [{"name": "a", "api_key_sha256": "0" * 64}]}})


def test_the_429_split_takes_the_routers_probe_and_both_loops_lag_inside_the_window(tmp_path):
    """shed_split: client-measured 429s by reason, the router's own answer time and loop lag (the
    server's samples), Locust's own loop lag; and the verify rounds' time outside the router (the users'
    less the router's Server-Timing); samples outside the steady window do not count."""
    _counters(tmp_path / "counters.json", {"default": {"shed": 4}}, {"default": 10})
    data = json.loads((tmp_path / "counters.json").read_text())
    data.update(shed_ms=[5000.0, 40.0, 60.0, 300.0], shed_at=[T0 + 1, T0 + 10, T0 + 11, T0 + 12],
                shed_why=["queue_full", "queue_full", "new_sessions_paused", "queue_full"],
                shed_connect_ms=[0.0, 0.0, 0.0, 250.0],
                loop_lag_ms=[[T0 + 1, 900.0], [T0 + 10, 2.0], [T0 + 11, 30.0]],
                loop_cpu_share=[[T0 + 1, 0.1], [T0 + 10, 0.5], [T0 + 11, 0.95]],  # the 30 ms lag: its own work
                loop_cpu_s=[[T0 + 1, 0.5], [T0 + 10, 0.026], [T0 + 11, 0.076]],  # its CPU seconds in each sample
                gc_pause_ms=[[T0 + 1, 400.0], [T0 + 10, 3.0], [T0 + 11, 120.0]], gc_gen=[2, 0, 2],
                verify_outside_ms=[[T0 + 1, 800.0], [T0 + 10, 4.0], [T0 + 11, 90.0]])
    (tmp_path / "counters.json").write_text(json.dumps(data))
    stats = tmp_path / "server_stats.json"
    stats.write_text(json.dumps({"samples": [], "router_probe": {
        "shed_ms": [[T0 + 1, 800.0], [T0 + 10, 0.4], [T0 + 12, 0.6]],
        "loop_lag_ms": [[T0 + 2, 700.0], [T0 + 10, 1.0], [T0 + 11, 25.0]],
        "gc_pause_ms": [[T0 + 1, 500.0], [T0 + 10, 2.0], [T0 + 11, 150.0]],
        "gc_cpu_ms": [[T0 + 1, 480.0], [T0 + 10, 2.0], [T0 + 11, 20.0]],  # the 150 ms one waited for a core
        "gc_gen": [[T0 + 1, 2.0], [T0 + 10, 0.0], [T0 + 11, 1.0]], "gc_collected": [[T0 + 10, 40.0], [T0 + 11, 9000.0]],
        "verify_ms": [[T0 + 1, 900.0], [T0 + 10, 30.0], [T0 + 11, 50.0]]}}))
    s = summarize(tmp_path, scenario("edge"), _meta(), stats)  # window: 1 s spawn + 3 s warm-up + 2 s on
    sp = s["shed_split"]
    assert sp["client_ms"] == {"n": 3, "p50": 60.0, "p99": 300.0, "max": 300.0}
    assert sp["client_ms_by_reason"]["queue_full"]["n"] == 2
    assert sp["client_ms_after_connect"]["max"] == 60.0 and sp["with_connect"] == 1  # 300 ms, 250 of them connecting
    assert sp["client_ms_by_reason"]["new_sessions_paused"]["p99"] == 60.0
    assert sp["router_answer_ms"]["max"] == 0.6 and sp["router_loop_lag_ms"]["p99"] == 25.0
    assert sp["locust_loop_lag_ms"]["n"] == 2 and sp["locust_loop_lag_ms"]["max"] == 30.0
    assert sp["locust_lagging_cpu_share"]["n"] == 1 and sp["locust_lagging_cpu_share"]["max"] == 0.95
    assert sp["locust_gc_pause_ms"]["n"] == 2 and sp["locust_gc_full_ms"]["max"] == 120.0
    assert s["locust_cores_window"] == pytest.approx(0.102 / (s["window_s"][1] - s["window_s"][0]))
    assert s["shed_ms_window"]["p99"] == 300.0  # the figure the check reads is the client's
    assert s["router_verify_ms_window"] == {"n": 2, "p50": 30.0, "p95": 50.0, "p99": 50.0}  # the router's own time
    assert "| the same, the router's verifier call alone p50 / p95 / p99 (ms) | | 30 / 50 / 50 |" in markdown(s)
    assert s["verify_outside_router_ms_window"] == {"n": 2, "p50": 4.0, "p99": 90.0, "max": 90.0}  # Locust's side
    assert "outside the router (the users' less its Server-Timing) p50 / p99 (ms) | | 4 / 90 |" in markdown(s)
    assert sp["router_gc_pause_ms"]["max"] == 150.0 and sp["router_gc_cpu_ms"]["max"] == 20.0
    assert sp["router_gc_full_ms"]["n"] == 0  # the full collection fell before the window
    assert ("router GC 2 pauses, 2.0 / 150.0 (max 150); their CPU 2.0 / 20.0 (max 20); objects freed per "
            "collection 40 / 9,000") in markdown(s)
    assert "Locust at nice" not in markdown(s)
    s["run"]["client_niceness"] = -5
    assert "Locust at nice -5)" in markdown(s)  # a run whose clients had the CPU first says so
    s["run"]["client_autogroup"] = True
    assert "Locust at nice -5 in a session of its own)" in markdown(s)  # its nice weighed against the server's


def test_tenants_objective_is_tenants_with_the_production_latency_objective():
    fair, slo = scenario("tenants"), scenario("tenants-objective")
    assert fair.app_config().router.latency_objective_s is None
    assert slo.app_config().router.latency_objective_s == 1.0 and slo.fairness
    strip = lambda app: {**app, "router": {k: v for k, v in app["router"].items() if k != "latency_objective_s"}}  # noqa: E731
    assert strip(slo.app) == strip(fair.app) and slo.user == fair.user


@pytest.mark.parametrize("in_window, holds", [(1, True), (5, False)])
def test_held_takes_the_shed_rate_of_the_steady_window_like_the_p99(tmp_path, in_window, holds):
    """The spawn burst (every user opening a session within seconds) is shed by the new-session
    pause; like the p99, the 1 % rule is read in the steady window (200 admitted rounds there)."""
    _counters(tmp_path / "counters.json", {"default": {"shed": 20}}, {"default": 10})
    data = json.loads((tmp_path / "counters.json").read_text())
    spawn = 20 - in_window
    data.update(verify_ms={"default": [10.0] * 200}, verify_at={"default": [T0 + 10] * 200},
                shed_ms=[5.0] * 20, shed_at=[T0 + 0.5] * spawn + [T0 + 10] * in_window,
                shed_why=["new_sessions_paused"] * 20, shed_connect_ms=[0.0] * 20, loop_lag_ms=[])
    (tmp_path / "counters.json").write_text(json.dumps(data))
    s = summarize(tmp_path, scenario("edge"), _meta(), None)
    assert s["rate_429_window"] == pytest.approx(in_window / (200 + in_window))
    s["rate_429"] = 0.05  # the whole run's, spawn included, over the rule either way
    assert held(s) is holds


@pytest.mark.parametrize("steady_ms, ok", [(5.0, True), (300.0, False)])
def test_the_429_check_reads_the_steady_window(tmp_path, steady_ms, ok):
    """Slow 429s of the spawn burst do not fail the check; slow ones in the steady state do."""
    _counters(tmp_path / "counters.json", {"default": {"shed": 20}}, {"default": 10})
    data = json.loads((tmp_path / "counters.json").read_text())
    data.update(shed_ms=[5000.0] * 10 + [steady_ms] * 10, shed_at=[T0 + 0.5] * 10 + [T0 + 10] * 10,
                shed_why=["new_sessions_paused"] * 20, shed_connect_ms=[0.0] * 20, loop_lag_ms=[])
    (tmp_path / "counters.json").write_text(json.dumps(data))
    s = summarize(tmp_path, scenario("edge"), _meta(), None)
    check = next(c for c in s["checks"] if c["name"].startswith("429s answered fast"))
    assert check["ok"] is ok and "10 in the window (20 in all)" in check["detail"]


def test_the_latency_probe_is_summarised_per_kind_and_status_inside_the_window(tmp_path):
    from loadtests.probe import summarise
    from loadtests.report import _probe_text, probe_summary

    rounds = ([{"t": 100.0 + i, "kind": "verify", "status": 200, "ms": 10.0 + i} for i in range(10)]
              + [{"t": 100.5 + i, "kind": "open", "status": 429, "ms": 2.0 + i} for i in range(10)]
              + [{"t": 50.0, "kind": "open", "status": 429, "ms": 900.0}])  # before the window
    assert summarise(rounds)["open 429"]["n"] == 11
    (tmp_path / "probe.json").write_text(json.dumps({"rate": 20, "tenant": "a", "priority": "nice -10",
                                                     "rounds": rounds}))
    pr = probe_summary(tmp_path / "probe.json", (100.0, 200.0))
    assert pr["by_status"]["open 429"]["n"] == 10 and pr["by_status"]["open 429"]["max"] == 11.0
    assert pr["by_status"]["verify 200"]["n"] == 10
    assert "10 of them" in _probe_text(pr, "429") and _probe_text(pr, "503") == ""
    assert probe_summary(tmp_path / "absent.json", (0, 1)) is None


@pytest.mark.parametrize("open_ms,past", [([100.0] * 99 + [1900.0], 0), ([100.0] * 99 + [5001.0], 1)])
def test_admitted_opens_past_the_deadline_fail_the_check(tmp_path, open_ms, past):
    cfg = scenario("smoke")
    _counters(tmp_path / "counters.json", {"gold": {}, "bronze": {}}, {"gold": 75, "bronze": 25})
    data = json.loads((tmp_path / "counters.json").read_text())
    (tmp_path / "counters.json").write_text(json.dumps({**data, "open_ms": open_ms}))
    s = summarize(tmp_path, cfg, _meta(), None)
    assert s["open_ms"]["past_deadline"] == past and s["open_ms"]["p50"] == 100.0
    check = next(c for c in s["checks"] if c["name"] == "no admitted open past its deadline")
    assert check["ok"] == (past == 0)
    assert "admitted opens p50 / p99" in markdown(s)


def test_opens_refused_while_the_verifier_idles_fail_the_cold_start_check(tmp_path):
    """An open refused for its deadline counts against the verifier only when every server sample from
    a second before it to a second after showed nothing pending (issue 67): a refusal at a burst's
    first instant, before a sample shows the burst's opens, is not one."""
    cfg = scenario("cold-start")
    assert cfg.spawn_at_once and cfg.max_idle_open_refusals == 0
    _counters(tmp_path / "counters.json", {"default": {}}, {"default": 10})
    data = json.loads((tmp_path / "counters.json").read_text())
    busy, idle, other, burst = T0 + 10.0, T0 + 20.0, T0 + 30.0, T0 + 8.6  # the burst shows in the sample at 9
    (tmp_path / "counters.json").write_text(json.dumps({
        **data, "shed_at": [busy, idle, other, burst],
        "shed_why": ["open_deadline", "open_deadline_passed", "queue_full", "open_deadline"],
        "shed_ms": [1.0] * 4, "shed_connect_ms": [0.0] * 4}))
    samples = [{"t": T0 + x / 4, "pending": 3 if 36 <= x <= 40 else 0, "replica": "r", "uptime_seconds": x / 4,
                "busy_seconds": 0.0, "mean_batch": 0.0} for x in range(160)]
    (tmp_path / "server_stats.json").write_text(json.dumps({"samples": samples}))
    s = summarize(tmp_path, cfg, _meta(), tmp_path / "server_stats.json")
    assert s["open_refusals"] == {"deadline": 3, "while_idle": 1}
    check = next(c for c in s["checks"] if "while the verifier was idle" in c["name"])
    assert not check["ok"] and "while idle: 1" in check["detail"]
    assert "opens refused for their deadline" in markdown(s)


def test_rss_growth_counts_each_process_from_its_own_warm_up():
    """A router replaced mid-run (a node lost) grows while it warms up, as the first one did before the
    window: its growth counts from its own warm-up; a process that keeps growing after it still shows."""
    from loadtests.report import process_summary

    def sample(t: float, rss: dict) -> dict:
        return {"t": t, "rss": rss, "cpu_s_by_role": {"router": t / 2}, "cpu_s_total": t,
                "host_cpu_s": {"user": t * 0.75, "softirq": t * 0.05, "idle": t * 1.2}}

    mb = 2 ** 20
    procs = []
    for t in range(0, 1200, 5):
        rss = {"1": ("verifier", (400 + (50 if t >= 60 else t * 50 / 60)) * mb)}
        if t < 240:
            rss["2"] = ("router", (180 + min(t, 60)) * mb)
        else:  # the replacement, born at 240 s: 180 MB then +60 MB over its first minute, then flat
            rss["3"] = ("router", (180 + min(t - 240, 60)) * mb)
        rss["4"] = ("proxy", (200 + t / 20) * mb)  # a slow leak: +5 MB a minute throughout
        procs.append(sample(float(t), rss))
    out = process_summary(procs, (60.0, 1195.0))
    assert out["rss_growth"]["router"] == 0.0  # not the replacement's warm-up (240 -> 180 MB would read +33 %)
    assert out["rss_growth"]["verifier"] == 0.0
    assert out["rss_growth"]["proxy"] > 0.2  # 203 -> 259.75 MB
    assert out["host_cores"] == pytest.approx({"user": 0.75, "softirq": 0.05, "idle": 1.2})  # the host's, by state


def test_the_verifiers_own_figures_come_from_its_counters_inside_the_window(tmp_path):
    """server_summary's replica_window: the replica's counters (deploy/verifier/stats_window.py) between its
    first and last samples inside the steady window; absent from samples without those totals (older runs)."""
    import json

    from loadtests.report import server_summary

    def sample(t: float) -> dict:  # 10 rounds a second of 20 ms each, 2 forwards a second of 5 sessions, 1 ms CPU
        return {"replica": "r0", "t": t, "pending": 3, "mean_batch": 5.0, "uptime_seconds": t, "busy_seconds": t / 10,
                "busy_cpu_seconds": {"prefill": 0.0, "verify": t * 2e-3}, "verify_forwards_total": 2 * t,
                "verify_sessions_total": 10 * t, "verify_rows_total": 40 * t, "verify_requests_total": 10 * t,
                "verify_request_seconds_total": 0.9 * t if t < 10 else 9.0 + 0.2 * (t - 10)}  # slow before the window
    path = tmp_path / "server_stats.json"
    path.write_text(json.dumps({"samples": [sample(float(t)) for t in range(0, 60)]}))
    out = server_summary(path, (10.0, 50.0), 32)
    assert out["replica_window"] == pytest.approx({"verify_forwards_per_s": 2.0, "sessions_per_forward": 5.0,
                                                   "rows_per_forward": 20.0, "forward_cpu_ms": 1.0,
                                                   "round_ms_mean": 20.0})
    old = [{k: v for k, v in sample(float(t)).items() if not k.startswith("verify_")} for t in range(0, 60)]
    path.write_text(json.dumps({"samples": old}))
    assert server_summary(path, (10.0, 50.0), 32)["replica_window"] is None


def test_where_users_wait_counts_each_wait_inside_the_window_and_the_sessions_each_replica_holds(tmp_path):
    """waits: the window's 429s' Retry-After by reason, each Retry-After waited out by the part of it
    inside the window (over the window's length), and the sessions held (each replica's samples' mean,
    summed over the replicas)."""
    from loadtests.report import waits

    counters = {"shed_at": [T0 + 1, T0 + 12, T0 + 13, T0 + 14], "shed_why": ["new_sessions_paused"] * 3 + ["queue_full"],
                "shed_retry_after": [9.0, 1.0, 3.0, 2.0],
                "backoffs": [[T0 + 5, 10.0, "open"], [T0 + 12, 2.0, "open"], [T0 + 14, 1.0, "verify"]]}
    samples = [{"t": T0 + t, "replica": r, "sessions": n} for t in range(0, 30)
               for r, n in (("a", 10 if t < 20 else 30), ("b", 4))]
    path = tmp_path / "server_stats.json"
    path.write_text(json.dumps({"samples": samples}))
    w = waits(counters, path, (T0 + 10, T0 + 20))
    assert w["retry_after_s"] == {"new_sessions_paused": {"n": 2, "p50": 1.0, "mean": 2.0, "max": 3.0},
                                  "queue_full": {"n": 1, "p50": 2.0, "mean": 2.0, "max": 2.0}}
    assert w["users_waiting_retry_after"] == pytest.approx({"open": (5.0 + 2.0) / 10, "verify": 0.1})
    assert w["sessions_held"] == pytest.approx((10 * 10 + 30) / 11 + 4)  # a's samples at 10-20 s, b's 4
    assert waits({"shed_at": [], "shed_why": [], "shed_retry_after": [], "backoffs": []}, None,
                 (T0, T0 + 1)) == {"retry_after_s": {}, "users_waiting_retry_after": {}, "sessions_held": None}
