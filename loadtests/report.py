"""The load-test report: Locust's CSVs + the users' counters + the verifier's samples.

Figures (``summary.json``, ``report.md``, PNG plots):

- requests/s (all HTTP requests) and verify rounds/s; verify latency p50/p95/p99 over the
  whole run (Locust's) and over the steady-state window (all users spawned, after a
  warm-up; from the users' own records);
- tokens/s served (first tokens + accepted + bonus tokens, as the users received them);
- the 429 rate (shed answers / all requests) and how fast the 429s came back; 503s
  (verifier restarting) and re-opens (404/410) separately; errors = everything else
  (other statuses, connection errors, timeouts, retries exhausted);
- sessions: opened, closed (404/410 on close: already gone with a killed replica), superseded by a
  re-open, left unclosed;
- per tenant: tokens served in the steady-state window, its share vs. its weight's share
  (weights only matter while the verifier is saturated: the verifier's queue is sampled);
- acceptance: accepted nodes per round measured vs. the acceptance model's expectation,
  rounds where the server accepted other than the model made correct, and sessions whose
  tokens left the target's greedy continuation (a losslessness check under load).

Checks (``--check``, the smoke test): zero errors, every session closed, and with
``fairness`` each tenant's share within 20% of its weight's share under saturation.
"""

from __future__ import annotations

import bisect
import csv
import glob
import json
import math
import os
import platform
from collections import defaultdict
from pathlib import Path

from benchmarks.bursts import profile_dict
from deploy.verifier.stats_window import mean_figures, window_figures
from loadtests.config import LoadTestConfig

SHARE_TOLERANCE = 0.20
HELD_P99_MS = 1000.0
HELD_MAX_SHED = 0.01


def _float(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = max(0, min(len(v) - 1, math.ceil(q / 100.0 * len(v)) - 1))
    return v[k]


def read_locust_stats(path: Path) -> dict[str, dict]:
    """``<prefix>_stats.csv`` rows by Name (``Aggregated`` included)."""
    if not path.exists():
        return {}
    with open(path) as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def read_locust_history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


# the Locust processes' own samples (loop lag, its CPU, collections), concatenated across processes
SAMPLE_KEYS = ("loop_lag_ms", "loop_cpu_share", "loop_cpu_s", "gc_pause_ms", "gc_gen", "verify_outside_ms")


def merge_counters(paths: list[Path]) -> dict:
    """Sum the counters of every Locust process."""
    tenants: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    merged = {"shed_reasons": defaultdict(int), "error_kinds": defaultdict(int), "ws_lost": defaultdict(int),
              "tokens_by_second": defaultdict(lambda: defaultdict(int)), "verify_ms": defaultdict(list),
              "verify_at": defaultdict(list), "shed_ms": [], "open_ms": [], "open_at": [], "shed_at": [], "shed_why": [], "shed_retry_after": [], "backoffs": [], "shed_connect_ms": [], **{k: [] for k in SAMPLE_KEYS}, "processes": 0}
    for p in paths:
        d = json.loads(Path(p).read_text())
        merged["processes"] += 1
        for t, c in d["tenants"].items():
            for k, v in c.items():
                tenants[t][k] += v
        for key in ("shed_reasons", "error_kinds", "ws_lost"):
            for k, v in d.get(key, {}).items():
                merged[key][k] += v
        for s, per in d["tokens_by_second"].items():
            for t, v in per.items():
                merged["tokens_by_second"][int(s)][t] += v
        for key in ("verify_ms", "verify_at"):
            for t, v in d[key].items():
                merged[key][t].extend(v)
        merged["shed_ms"].extend(d["shed_ms"])
        merged["open_ms"].extend(d.get("open_ms", []))
        merged["open_at"].extend(d.get("open_at", [None] * len(d.get("open_ms", []))))
        for k in SAMPLE_KEYS:
            merged[k].extend(d.get(k, []))
        merged["shed_at"].extend(d.get("shed_at", [None] * len(d["shed_ms"])))
        merged["shed_why"].extend(d.get("shed_why", [None] * len(d["shed_ms"])))
        merged["shed_connect_ms"].extend(d.get("shed_connect_ms", [0.0] * len(d["shed_ms"])))
        merged["shed_retry_after"].extend(d.get("shed_retry_after", [None] * len(d["shed_ms"])))
        merged["backoffs"].extend(d.get("backoffs", []))
    merged["tenants"] = {t: dict(c) for t, c in tenants.items()}
    return merged


def steady_window(history: list[dict], users: int, warmup_s: float, fallback: tuple[float, float]):
    """(start, end) epoch seconds: all users spawned + warm-up, until the last full-load sample."""
    full = [int(r["Timestamp"]) for r in history if r.get("Name") == "Aggregated"
            and r.get("User Count") and int(r["User Count"]) >= users]
    if len(full) >= 2:  # the last seconds are the stop: users close their sessions, queues drain
        return full[0] + warmup_s, float(full[-1]) - 2.0
    return fallback


def server_summary(stats_path: Path | None, window: tuple[float, float], max_batch: int) -> dict:
    """Verifier queue length, batch size, busy fraction (the forwards' wall) and forward CPU (their
    thread's CPU, cores) inside the window (per replica)."""
    if stats_path is None or not Path(stats_path).exists():
        return {"available": False}
    data = json.loads(Path(stats_path).read_text())
    lo, hi = window
    inside = [s for s in data["samples"] if lo <= s["t"] <= hi]
    by_replica: dict[str, list[dict]] = defaultdict(list)
    for s in data["samples"]:
        by_replica[s["replica"]].append(s)
    busy, cpu, own = [], [], []
    for rs in by_replica.values():
        w = [s for s in rs if lo <= s["t"] <= hi]
        if len(w) >= 2 and "verify_requests_total" in w[0]:
            own.append(window_figures(w[0], w[-1]))
        if len(w) >= 2 and w[-1]["uptime_seconds"] > w[0]["uptime_seconds"]:
            up = w[-1]["uptime_seconds"] - w[0]["uptime_seconds"]
            busy.append((w[-1]["busy_seconds"] - w[0]["busy_seconds"]) / up)
            if "busy_cpu_seconds" in w[0]:
                cpu.append((sum(w[-1]["busy_cpu_seconds"].values()) - sum(w[0]["busy_cpu_seconds"].values())) / up)
    pending = [s["pending"] for s in inside]
    backlogged = sum(1 for p in pending if p >= max_batch) / len(pending) if pending else float("nan")
    mean_pending = sum(pending) / len(pending) if pending else float("nan")
    return {"available": True, "samples": len(inside), "replicas_seen": len(by_replica),
            "mean_pending": mean_pending,
            "mean_batch_sessions": (sum(s["mean_batch"] for s in inside) / len(inside)) if inside else float("nan"),
            "busy_fraction": (sum(busy) / len(busy)) if busy else float("nan"),
            "forward_cpu_cores": (sum(cpu) / len(cpu)) if cpu else float("nan"),
            "backlogged_fraction": backlogged,  # samples with a full batch waiting
            "replica_window": mean_figures(own),  # its own counters' (deploy/verifier/counters.py), None: older
            "saturated": bool(pending) and mean_pending >= max_batch,
            "events": data.get("events", []), **process_summary(data.get("procs", []), window),
            # the background processes' CPU bursts in the window (None: older runs, or no period)
            "background_bursts": profile_dict(data.get("background_cpu", []), *window)}


def process_summary(procs: list[dict], window: tuple[float, float]) -> dict:
    """From the server's 5-second process samples: cores used per role over the window (CPU
    seconds / wall seconds; a process that died inside it loses its CPU, so a kill makes its
    role read low), the whole host's cores by CPU state (/proc/stat: user, system, idle, softirq,
    steal...), and each router/verifier process's RSS growth from its first sample past its
    own warm-up (the run's: the window's start after the first sample; a replacement started by a
    fault warms up as the first processes did) to its last, for processes seen that long for at
    least half the window."""
    lo, hi = window
    inside = [p for p in procs if lo <= p["t"] <= hi]
    if len(inside) < 2:
        return {}
    warm = max(0.0, lo - procs[0]["t"])
    born: dict[str, float] = {}
    for p in procs:
        for pid in p["rss"]:
            born.setdefault(pid, p["t"])
    a, b = inside[0], inside[-1]
    dt = max(b["t"] - a["t"], 1e-9)
    cores = {r: max(0.0, (b["cpu_s_by_role"].get(r, 0.0) - a["cpu_s_by_role"].get(r, 0.0)) / dt)
             for r in b["cpu_s_by_role"]}
    seen: dict[str, list[tuple[float, str, int]]] = defaultdict(list)
    for p in inside:
        for pid, (role, rss) in p["rss"].items():
            if rss and p["t"] >= born[pid] + warm:
                seen[pid].append((p["t"], role, rss))
    growth: dict[str, float] = {}
    rss_mb: dict[str, float] = {}
    for pid, xs in seen.items():
        role = xs[0][1]
        rss_mb[role] = max(rss_mb.get(role, 0.0), xs[-1][2] / 2**20)
        if xs[-1][0] - xs[0][0] >= 0.5 * (hi - lo):
            growth[role] = max(growth.get(role, -1.0), xs[-1][2] / xs[0][2] - 1.0)
    h0, h1 = a.get("host_cpu_s", {}), b.get("host_cpu_s", {})  # older runs: none
    host = {k: (h1[k] - h0[k]) / dt for k in h1 if k in h0}
    return {"cores_by_role": dict(sorted(cores.items())), "cores_total": (b["cpu_s_total"] - a["cpu_s_total"]) / dt,
            "host_cores": host, "rss_growth": growth, "rss_mb": rss_mb}


def _pcts(samples: list, window: tuple[float, float]) -> dict:
    """p50 / p99 / max (and the count) of (epoch s, ms) samples inside the window."""
    xs = [ms for t, ms in samples if window[0] <= t < window[1]]
    return {"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs, default=float("nan"))}


def probe_summary(path: Path, window: tuple[float, float]) -> dict | None:
    """The latency probe's requests (loadtests/probe.py) in the steady window, by kind and status
    ("open 429"), with their milliseconds; None without a probe."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    by: dict[str, list] = defaultdict(list)
    for r in data["rounds"]:
        by[f"{r['kind']} {r['status']}"].append((r["t"], r["ms"]))
    return {"rate": data["rate"], "tenant": data["tenant"], "priority": data["priority"],
            "by_status": {k: dict(_pcts(v, window), ms=[ms for t, ms in v if window[0] <= t < window[1]])
                          for k, v in sorted(by.items())}}


def router_probe(stats_path: Path | None) -> dict:
    """The router's probe samples of a run (loadtests/server.py), empty without them."""
    if stats_path is None or not Path(stats_path).exists():
        return {}
    return json.loads(Path(stats_path).read_text()).get("router_probe", {})


def shed_split(counters: dict, stats_path: Path | None, window: tuple[float, float]) -> dict:
    """Where a 429's time goes (steady state): what the client measured, by shed reason; the
    router's own time per 429 (request at its ASGI app to answer sent) and its event loop's lag
    (deploy/router/probe.py); the Locust process's own loop lag (the client's share)."""
    client = list(zip(counters["shed_at"], counters["shed_ms"]))
    sent = [(at, ms - c) for at, ms, c in zip(counters["shed_at"], counters["shed_ms"], counters["shed_connect_ms"])]
    by_reason = defaultdict(list)
    for at, ms, why in zip(counters["shed_at"], counters["shed_ms"], counters["shed_why"]):
        by_reason[why or "unknown"].append((at, ms))
    probe = router_probe(stats_path)
    return {"client_ms": _pcts([x for x in client if x[0]], window),
            "client_ms_by_reason": {r: _pcts(v, window) for r, v in sorted(by_reason.items())},
            # without the WebSocket (re)connect some rounds began with (a user that slept out a long
            # Retry-After closed its socket): from the frame sent to the 429 read
            "client_ms_after_connect": _pcts([x for x in sent if x[0]], window),
            "with_connect": sum(1 for at, c in zip(counters["shed_at"], counters["shed_connect_ms"])
                                if at and c and window[0] <= at < window[1]),
            "router_answer_ms": _pcts(probe.get("shed_ms", []), window),
            "router_loop_lag_ms": _pcts(probe.get("loop_lag_ms", []), window),
            # the router's garbage collections (each stops its loop whole); n / window = per second
            "router_gc_pause_ms": _pcts(probe.get("gc_pause_ms", []), window),
            "router_gc_cpu_ms": _pcts(probe.get("gc_cpu_ms", []), window),  # the same, CPU time
            # the full (generation-2) ones: the pauses whose sample in gc_gen (same order) says 2
            "router_gc_full_ms": _pcts([p for p, (_, g) in zip(probe.get("gc_pause_ms", []), probe.get("gc_gen", []))
                                        if g == 2], window),
            "router_gc_freed": _pcts(probe.get("gc_collected", []), window),  # cyclic garbage freed by each
            "locust_loop_lag_ms": _pcts(counters["loop_lag_ms"], window),
            # the Locust process's share of each lag sample's wall it ran, over the samples that lagged most
            "locust_lagging_cpu_share": _pcts(_lagging(counters, window), window),
            "locust_gc_pause_ms": _pcts(counters["gc_pause_ms"], window),
            "locust_gc_full_ms": _pcts([p for p, g in zip(counters["gc_pause_ms"], counters["gc_gen"]) if g == 2],
                                       window)}


def _lagging(counters: dict, window: tuple[float, float]) -> list:
    """(epoch s, CPU share) of the window's Locust loop-lag samples at or above their p99: its own work
    (share near 1) or the CPU given elsewhere (low)."""
    lag, cpu = counters.get("loop_lag_ms", []), counters.get("loop_cpu_share", [])
    if len(cpu) != len(lag):
        return []
    inside = [(t, ms, share) for (t, ms), (_, share) in zip(lag, cpu) if window[0] <= t < window[1]]
    cut = percentile([ms for _, ms, _ in inside], 99)
    return [(t, share) for t, ms, share in inside if ms >= cut]


def waits(counters: dict, stats_path: Path | None, window: tuple[float, float]) -> dict:
    """Where the users wait in the steady window: the Retry-After of its 429s by shed reason (p50,
    mean, max, s), the users waiting one out on average by the request it answered ("open": holding
    no session; "verify", "close": holding one; each wait's part inside the window over the window's
    length), and the sessions the verifier replicas hold (each replica's samples' mean, summed;
    None without samples)."""
    lo, hi = window
    told = defaultdict(list)
    for at, why, ra in zip(counters["shed_at"], counters["shed_why"], counters["shed_retry_after"]):
        if at and ra is not None and lo <= at < hi:
            told[why or "unknown"].append(ra)
    waiting: dict[str, float] = defaultdict(float)
    for at, seconds, kind in counters["backoffs"]:
        waiting[kind] += seconds_inside(at, seconds, window) / max(hi - lo, 1e-9)
    held = None
    if stats_path is not None and Path(stats_path).exists():
        by_replica: dict[str, list[int]] = defaultdict(list)  # each sample is one replica's (Serve picks it)
        for smp in json.loads(Path(stats_path).read_text())["samples"]:
            if lo <= smp["t"] <= hi and "sessions" in smp:
                by_replica[smp["replica"]].append(smp["sessions"])
        held = sum(sum(v) / len(v) for v in by_replica.values()) if by_replica else None
    return {"retry_after_s": retry_after_summary(told), "users_waiting_retry_after": dict(sorted(waiting.items())),
            "sessions_held": held}


def seconds_inside(at: float, seconds: float, window: tuple[float, float]) -> float:
    """How much of a wait from ``at`` for ``seconds`` falls inside ``window``."""
    return max(0.0, min(window[1], at + seconds) - max(window[0], at))


def retry_after_summary(told: dict[str, list[float]]) -> dict:
    """The Retry-After of 429s by shed reason: count, p50, mean, max (s)."""
    return {r: {"n": len(v), "p50": percentile(v, 50), "mean": sum(v) / len(v), "max": max(v)}
            for r, v in sorted(told.items())}


def router_verify(stats_path: Path | None, window: tuple[float, float]) -> dict:
    """p50 / p95 / p99 (and the count) of the router's verifier-call times of admitted verify rounds in the window."""
    xs = [ms for t, ms in router_probe(stats_path).get("verify_ms", []) if window[0] <= t < window[1]]
    return {"n": len(xs), **{f"p{q}": percentile(xs, q) for q in (50, 95, 99)}}


OPEN_DEADLINE_REASONS = ("open_deadline", "open_deadline_passed")


def open_refusals(counters: dict, stats_path: Path | None) -> dict:
    """Opens refused for their deadline (429, reasons :data:`OPEN_DEADLINE_REASONS`), and of those
    the ones refused while the verifier was idle: every verifier sample from a second before the
    refusal to a second after showed nothing pending (no verify round, no open). The second after
    counts: samples come every 0.25 s, and a burst's first opens reach the verifier between two.
    ``while_idle`` None: no samples."""
    at = sorted(t for t, why in zip(counters["shed_at"], counters["shed_why"]) if why in OPEN_DEADLINE_REASONS)
    if stats_path is None or not Path(stats_path).exists():
        return {"deadline": len(at), "while_idle": None}
    samples = sorted((smp["t"], smp["pending"]) for smp in json.loads(Path(stats_path).read_text())["samples"])
    times = [t for t, _ in samples]
    idle = 0
    for t in at:
        around = samples[bisect.bisect_left(times, t - 1.0): bisect.bisect_right(times, t + 1.0)]
        idle += bool(around) and max(p for _, p in around) == 0
    return {"deadline": len(at), "while_idle": idle}


def backlogged_seconds(stats_path: Path | None, max_batch: int) -> set[int] | None:
    """Epoch seconds during which every verifier sample (and those of the seconds before and after)
    had a full batch waiting: the times when weighted-fair scheduling decides who is served.
    None: no samples."""
    if stats_path is None or not Path(stats_path).exists():
        return None
    by_sec: dict[int, list[int]] = defaultdict(list)
    for smp in json.loads(Path(stats_path).read_text())["samples"]:
        by_sec[int(smp["t"])].append(smp["pending"])
    full = {s for s, p in by_sec.items() if p and min(p) >= max(2 * max_batch, 4)}
    return {s for s in full if s - 1 in full and s + 1 in full}  # responses reach users a little later


def summarize(out: Path, cfg: LoadTestConfig, meta: dict, server_stats: Path | None) -> dict:
    stats = read_locust_stats(out / "locust_stats.csv")
    history = read_locust_history(out / "locust_stats_history.csv")
    counters = merge_counters(sorted(glob.glob(str(out / "counters.json*"))))
    users, rate = meta["users"], meta["spawn_rate"]
    t0 = meta["locust_started"]
    fallback = (t0 + users / max(rate, 1e-9) + cfg.warmup_s + 2, meta["locust_ended"] - 2)
    window = steady_window(history, users, cfg.warmup_s, fallback)
    wlen = max(window[1] - window[0], 1e-9)
    agg = stats.get("Aggregated", {})
    rounds = [stats[n] for n in ("verify", "ws verify") if n in stats]  # POSTed and WebSocket rounds
    ver = max(rounds, key=lambda r: _float(r.get("Request Count", 0)), default={})
    total_requests = _float(agg.get("Request Count", 0))
    run_s = max(meta["locust_ended"] - t0, 1e-9)
    vc = cfg.app_config().verifier
    rc = cfg.app_config().router

    tc = counters["tenants"]
    tot = lambda k: sum(c.get(k, 0) for c in tc.values())  # noqa: E731
    shed, errors, unavailable = tot("shed"), tot("errors"), tot("unavailable")
    locust_failures = _float(agg.get("Failure Count", 0))
    opens, closes, superseded = tot("opens"), tot("closes"), tot("superseded")

    # per-tenant steady-state tokens and share vs. weight
    weights = cfg.tenant_weights()
    shares = cfg.user_shares()
    tok_win: dict[str, float] = defaultdict(float)
    tok_sat: dict[str, float] = defaultdict(float)  # only seconds with the verifier backlogged
    sat = backlogged_seconds(server_stats, vc.max_batch_sessions)
    for s, per in counters["tokens_by_second"].items():
        if window[0] <= s < window[1]:
            for t, v in per.items():
                tok_win[t] += v
                if sat is None or s in sat:
                    tok_sat[t] += v
    sat_secs = len([s for s in (sat or ()) if window[0] <= s < window[1]]) if sat is not None else None
    active = [t for t in shares if shares[t] > 0]
    wsum = sum(weights.get(t, 1.0) for t in active)
    tsum = sum(tok_win.values()) or 1e-9
    ssum = sum(tok_sat.values()) or 1e-9
    per_tenant = {}
    for t in active:
        c = tc.get(t, {})
        lat = [ms for ms, at in zip(counters["verify_ms"].get(t, []), counters["verify_at"].get(t, []))
               if window[0] <= at < window[1]]
        expected = weights.get(t, 1.0) / wsum
        share = tok_sat.get(t, 0.0) / ssum
        per_tenant[t] = {"weight": weights.get(t, 1.0), "user_share": shares[t], "weight_share": expected,
                         "tokens_window": tok_win.get(t, 0.0), "tokens_per_s": tok_win.get(t, 0.0) / wlen,
                         "token_share_window": tok_win.get(t, 0.0) / tsum,
                         "token_share": share, "share_over_weight": share / expected if expected else float("nan"),
                         "verify_p50_ms": percentile(lat, 50), "verify_p99_ms": percentile(lat, 99),
                         "tokens_total": c.get("tokens", 0), "shed": c.get("shed", 0), "errors": c.get("errors", 0)}

    all_lat = [ms for t in counters["verify_ms"] for ms, at in zip(counters["verify_ms"][t], counters["verify_at"][t])
               if window[0] <= at < window[1]]
    verifies = tot("verifies")
    shed_win = [ms for ms, at in zip(counters["shed_ms"], counters["shed_at"]) if at and window[0] <= at < window[1]]
    srv = server_summary(server_stats, window, vc.max_batch_sessions)
    summary = {
        "scenario": cfg.name, "description": cfg.description, "target": cfg.target,
        "server_model": meta.get("server_model", {}).get("model"),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "note": "load average {:.1f} / {:.1f} / {:.1f} (1/5/15 min) when the report was written"
                            .format(*os.getloadavg())},
        "limits": {"verifier_replicas": vc.num_replicas, "max_batch_sessions": vc.max_batch_sessions,
                   "max_batch_tokens": vc.max_batch_tokens, "batch_wait_ms": vc.batch_wait_ms,
                   "max_tree_nodes": vc.max_tree_nodes, "torch_threads": vc.torch_threads,
                   "router_max_pending_verifies": rc.max_pending_verifies,
                   "router_max_queued_batches": rc.max_queued_batches,
                   "tenant_max_sessions": {t.name: t.max_sessions for t in rc.load_tenants()}},
        "user_model": cfg.user.model_dump(mode="json"),
        "request_path": cfg.request_path.model_dump(mode="json"),
        "run": {**{k: meta[k] for k in ("users", "spawn_rate", "duration_s", "processes", "host", "started_app")},
                "worker_niceness": meta.get("worker_niceness"), "client_niceness": meta.get("client_niceness"),
                "client_autogroup": meta.get("client_autogroup")},
        "window_s": [round(window[0] - t0, 1), round(window[1] - t0, 1)],
        "backlogged_seconds": sat_secs,  # of the window, the seconds the share is computed over
        "requests_per_s": _float(agg.get("Requests/s", total_requests / run_s)),
        "verify_per_s": sum(_float(r.get("Requests/s")) for r in rounds) if rounds else float("nan"),
        "verify_per_s_window": len(all_lat) / wlen,
        "verify_ms": {"p50": _float(ver.get("50%")), "p95": _float(ver.get("95%")), "p99": _float(ver.get("99%"))},
        "verify_ms_window": {"p50": percentile(all_lat, 50), "p95": percentile(all_lat, 95),
                             "p99": percentile(all_lat, 99)},
        "tokens_per_s": tot("tokens") / run_s,
        "tokens_per_s_window": sum(tok_win.values()) / wlen,
        "rate_429": shed / total_requests if total_requests else 0.0,
        # the same in the steady window the p99 is taken over: 429s / (admitted rounds + 429s), opens left
        # out of the denominator (they carry no timestamp), so it errs high; the spawn burst is outside
        "rate_429_window": len(shed_win) / (len(all_lat) + len(shed_win)) if all_lat or shed_win else 0.0,
        "shed_429": shed, "shed_reasons": dict(counters["shed_reasons"]),
        "shed_ms": {"p50": percentile(counters["shed_ms"], 50), "p99": percentile(counters["shed_ms"], 99)},
        "shed_ms_window": {"p50": percentile(shed_win, 50), "p99": percentile(shed_win, 99)},
        # admitted opens (the time to the first token, client side) and those past router.open_deadline_s
        "open_ms": {"p50": percentile(counters["open_ms"], 50), "p99": percentile(counters["open_ms"], 99),
                    "past_deadline": sum(ms > rc.open_deadline_s * 1e3 for ms in counters["open_ms"]),
                    "deadline_s": rc.open_deadline_s},
        # the router's own time of each admitted verify round's verifier call (deploy/router/probe.py): the
        # served system's share of the users' verify_ms_window, without the load generator's waits
        "router_verify_ms_window": router_verify(server_stats, window),
        # each admitted verify round's time outside the router (the users' time less the router's Server-Timing):
        # the loopback and the load generator's own waits and CPU
        "verify_outside_router_ms_window": _pcts(counters["verify_outside_ms"], window),
        "shed_split": shed_split(counters, server_stats, window),
        "waits": waits(counters, server_stats, window),
        "open_refusals": open_refusals(counters, server_stats),
        "probe": probe_summary(out / "probe.json", window),
        "unavailable_503": unavailable, "reopens": tot("reopens"), "ws_lost": dict(counters["ws_lost"]),
        "errors": errors, "locust_failures": locust_failures, "error_kinds": dict(counters["error_kinds"]),
        "sessions": {"generations": tot("generations"), "finished": tot("finished"), "opened": opens,
                     "closed": closes, "closed_by_server": tot("closed_by_server"),
                     "closed_already_gone": tot("closed_gone"), "superseded": superseded,
                     "unclosed": opens - closes - superseded},
        "acceptance": {"rounds": verifies, "drafted_per_round": tot("drafted") / verifies if verifies else 0.0,
                       "depth_per_round": tot("depth") / verifies if verifies else 0.0,  # the trees' depths
                       "accepted_per_round": tot("accepted") / verifies if verifies else 0.0,
                       "model_expected_per_round": tot("expected") / verifies if verifies else 0.0,
                       "rounds_accepted_other_than_model": tot("accept_mismatch"),
                       "diverged_sessions": tot("diverged")},
        "tenants": per_tenant, "server": srv, "locust_processes": counters["processes"],
        "locust_cores": meta["locust_cpu_s"] / run_s if meta.get("locust_cpu_s") is not None else None,
        # the same in the steady window, from the lag samples' CPU (every Locust process's; None: older runs)
        "locust_cores_window": sum(c for t, c in counters["loop_cpu_s"] if window[0] <= t < window[1])
                               / (window[1] - window[0]) if counters["loop_cpu_s"] else None,
        "kill_sent_at_s": (meta["kill_sent_at"] - t0) if meta.get("kill_sent_at") else None,
        "kills_sent_at_s": [round(k - t0, 1) for k in meta.get("kills_sent_at", [])],
    }
    if cfg.cluster_workers:
        summary["faults"] = fault_summary(counters, srv.get("events", []), meta, t0, tot)
        # opens past the deadline by where they fell: within FAULT_WINDOW_S after a fault (the re-open storm of a
        # lost node's sessions, a router restarting elsewhere) or not
        faults_at = [e["t"] for e in srv.get("events", []) if e.get("event") in ("node_killed", "gcs_killed")]
        late = [at for ms, at in zip(counters["open_ms"], counters["open_at"]) if ms > rc.open_deadline_s * 1e3]
        near = [at for at in late if at is not None and any(0 <= at - f <= FAULT_WINDOW_S for f in faults_at)]
        summary["open_ms"]["past_deadline_after_faults"] = len(near)
        summary["faults"]["opens_past_deadline"] = {"within_s_of_a_fault": FAULT_WINDOW_S, "near": len(near),
                                                    "elsewhere": len(late) - len(near)}
    cores = srv.get("cores_by_role", {})
    summary["sizing"] = {  # verify rounds per second per core of each hop (steady state)
        role: summary["verify_per_s_window"] / cores[role] for role in ("router", "verifier", "proxy", "haproxy")
        if cores.get(role, 0.0) > 0.01}
    summary["checks"] = checks(summary, cfg)
    return summary


def checks(s: dict, cfg: LoadTestConfig) -> list[dict]:
    out = [
        {"name": "no errors other than 429", "ok": s["errors"] == 0 and s["locust_failures"] == 0,
         "detail": f"errors={s['errors']:g} locust_failures={s['locust_failures']:g} {s['error_kinds']}"},
        {"name": "every session closed", "ok": s["sessions"]["unclosed"] == 0 and s["sessions"]["opened"] > 0,
         "detail": json.dumps(s["sessions"])},
        {"name": "no admitted open past its deadline" + (
            f" (beyond {FAULT_WINDOW_S:g} s after a fault)" if "past_deadline_after_faults" in s["open_ms"] else ""),
         "ok": s["open_ms"]["past_deadline"] - s["open_ms"].get("past_deadline_after_faults", 0) == 0,
         "detail": f"past {s['open_ms']['deadline_s']:g} s: {s['open_ms']['past_deadline']:g}"
                   + (f" ({s['open_ms']['past_deadline_after_faults']:g} of them within {FAULT_WINDOW_S:g} s after a "
                      "node kill or the GCS restart)" if "past_deadline_after_faults" in s["open_ms"] else "")
                   + f"; admitted-open p50 / p99 {_f(s['open_ms']['p50'], 0)} / {_f(s['open_ms']['p99'], 0)} ms"},
        {"name": "output lossless under load", "ok": s["acceptance"]["diverged_sessions"] == 0,
         "detail": f"diverged sessions={s['acceptance']['diverged_sessions']:g} (greedy fp32 target)"},
    ]
    if cfg.max_idle_open_refusals is not None:
        r = s["open_refusals"]
        out.append({"name": f"at most {cfg.max_idle_open_refusals} opens refused for their deadline while the "
                            "verifier was idle",
                    "ok": r["while_idle"] is not None and r["while_idle"] <= cfg.max_idle_open_refusals,
                    "detail": f"refused for the deadline: {r['deadline']:g}, of them while idle: {r['while_idle']}"})
    if cfg.fairness:
        srv = s["server"]
        sat = srv.get("saturated", True) if srv.get("available") else True
        out.append({"name": "verifier saturated (weights apply)", "ok": bool(sat),
                    "detail": f"mean verifier queue {srv.get('mean_pending', float('nan')):.1f} vs batch limit "
                              f"{s['limits']['max_batch_sessions']}, a full batch waiting in "
                              f"{srv.get('backlogged_fraction', float('nan')):.0%} of the samples"})
        bad = {t: round(v["share_over_weight"], 3) for t, v in s["tenants"].items()
               if not abs(v["share_over_weight"] - 1.0) <= SHARE_TOLERANCE}
        nsat = s.get("backlogged_seconds")
        out.append({"name": f"per-tenant token share within {SHARE_TOLERANCE:.0%} of weight share",
                    "ok": not bad and len(s["tenants"]) > 1 and (nsat is None or nsat >= 5),
                    "detail": ", ".join(f"{t}: share {v['token_share']:.3f} vs weight {v['weight_share']:.3f}"
                                        for t, v in s["tenants"].items())
                              + (f" over {nsat} backlogged s" if nsat is not None else "")})
    if cfg.max_shed_ms is not None:
        # in the steady state, like the verify p99 (the spawn burst's opens are shed too; the whole
        # run's figures are in the report)
        p50, p99 = s["shed_ms_window"]["p50"], s["shed_ms_window"]["p99"]
        n_win = s["shed_split"]["client_ms"]["n"]
        out.append({"name": f"429s answered fast (p50 <= {cfg.max_shed_ms[0]:.0f} ms, p99 <= "
                            f"{cfg.max_shed_ms[1]:.0f} ms, steady state)",
                    "ok": (s["shed_429"] > 0 or not cfg.expect_shed) and (
                        n_win == 0 or (p50 <= cfg.max_shed_ms[0] and p99 <= cfg.max_shed_ms[1])),
                    "detail": f"429s={n_win:g} in the window ({s['shed_429']:g} in all) p50={_f(p50, 0)} ms "
                              f"p99={_f(p99, 0)} ms (whole run {_f(s['shed_ms']['p50'], 0)} / "
                              f"{_f(s['shed_ms']['p99'], 0)} ms){_probe_text(s.get('probe'), '429')}"})
    if cfg.max_verify_p99_ms is not None:
        p99 = s["verify_ms_window"]["p99"]
        out.append({"name": f"admitted verify rounds p99 <= {cfg.max_verify_p99_ms:.0f} ms (steady state)",
                    "ok": p99 <= cfg.max_verify_p99_ms, "detail": f"p99={_f(p99, 0)} ms"})
    if cfg.max_rss_growth is not None:
        g = s["server"].get("rss_growth", {})
        ok = bool(g) and all(g.get(r, 1.0) < cfg.max_rss_growth for r in ("router", "verifier"))
        out.append({"name": f"router and verifier RSS growth < {cfg.max_rss_growth:.0%} after warm-up",
                    "ok": ok, "detail": ", ".join(f"{r} {v:+.1%}" for r, v in sorted(g.items())) or "no samples"})
    if cfg.cluster_workers and "faults" in s:
        f = s["faults"]
        sent = [c for _, c in f["sent"]]
        back_ok = (len(f["restored_after_s"]) == len(f["nodes_back"]) == len(f["node_kills"])
                   and all(x <= (cfg.max_recovery_s or float("inf")) for x in f["restored_after_s"]))
        out.append({"name": "worker nodes killed as scheduled; Serve restored the verifier replicas after each "
                            "node's return" + (f" (within {cfg.max_recovery_s:g} s)" if cfg.max_recovery_s else ""),
                    "ok": len(f["node_kills"]) == sent.count("kill_node") > 0 and back_ok and not f["fault_errors"],
                    "detail": f"kills={len(f['node_kills'])}/{sent.count('kill_node')} back={len(f['nodes_back'])} "
                              f"restored after {f['restored_after_s']} s; errors {f['fault_errors']}"})
        if any(c.startswith("kill_gcs") for c in sent):
            g = f["gcs"]
            out.append({"name": "the head's GCS restarted from Redis and the app answered while it was down",
                        "ok": g.get("started_at_s") is not None and g.get("verifies_ok_during_outage", 0) > 0,
                        "detail": json.dumps(g)})
    if cfg.kill_verifier_at_s is not None:
        kills = [e for e in s["server"].get("events", []) if e.get("event") == "kill_verifier" and e.get("actor")]
        out.append({"name": "a verifier replica was killed and its sessions re-opened",
                    "ok": bool(kills) and s["reopens"] > 0,
                    "detail": f"kills={len(kills)} reopens={s['reopens']:g} 503s={s['unavailable_503']:g}"})
    return out


def held(s: dict) -> bool:
    """The deployment "holds" the users: in the steady state, p99 verify < 1 s and at most 1% shed;
    no errors over the whole run. (Both rates are reported; the whole run's includes the spawn,
    every user opening a session within seconds, which admission meets by pausing new sessions.)"""
    return (s["verify_ms_window"]["p99"] < HELD_P99_MS and s["errors"] == 0 and s["locust_failures"] == 0
            and s.get("rate_429_window", s["rate_429"]) <= HELD_MAX_SHED)


def _f(x, nd=1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "n/a"
    return f"{x:,.{nd}f}"


def _probe_text(pr: dict | None, status: str) -> str:
    """The latency probe's figure for one status (opens and rounds together), as a clause ('' without
    a probe or without such answers)."""
    samples = [d for k, d in (pr or {}).get("by_status", {}).items() if k.endswith(f" {status}") and d["n"]]
    if not samples:
        return ""
    ms = [x for d in samples for x in d["ms"]]
    return (f"; the latency probe ({pr['priority']}, {pr['rate']:g} requests/s) saw {len(ms)} of them at "
            f"p50 {_f(percentile(ms, 50), 0)} / p99 {_f(percentile(ms, 99), 0)} ms")


def _probe_cell(pr: dict | None) -> str:
    if not pr:
        return "not run"
    parts = [f"{k}: {_f(d['p50'], 0)} / {_f(d['p99'], 0)} (n {d['n']})" for k, d in pr["by_status"].items() if d["n"]]
    return f"{pr['priority']}, {pr['rate']:g} requests/s, tenant {pr['tenant']}; " + ("; ".join(parts) or "none")


def _split(sp: dict | None) -> str:
    if not sp:
        return "n/a"
    pp = lambda d: f"{_f(d['p50'], 1)} / {_f(d['p99'], 1)}"  # noqa: E731
    reasons = ", ".join(f"{r} {pp(d)}" for r, d in sp["client_ms_by_reason"].items() if d["n"])
    gcp = sp.get("router_gc_pause_ms")
    gc_ = f"{gcp['n']} pauses, {pp(gcp)} (max {_f(gcp['max'], 0)})" if gcp and gcp["n"] else "n/a"
    cpu, full = sp.get("router_gc_cpu_ms"), sp.get("router_gc_full_ms")
    if gcp and gcp["n"] and cpu and cpu["n"]:
        gc_ += f"; their CPU {pp(cpu)} (max {_f(cpu['max'], 0)})"
    freed = sp.get("router_gc_freed")
    if freed and freed["n"]:
        gc_ += f"; objects freed per collection {_f(freed['p50'], 0)} / {_f(freed['p99'], 0)}"
    if full and full["n"]:
        gc_ += f"; {full['n']} full, {pp(full)} (max {_f(full['max'], 0)})"
    lgc, lfull, share = sp.get("locust_gc_pause_ms"), sp.get("locust_gc_full_ms"), sp.get("locust_lagging_cpu_share")
    locust = ""
    if lgc and lgc["n"]:
        locust = f"; Locust GC {lgc['n']} pauses, {pp(lgc)} (max {_f(lgc['max'], 0)})"
        locust += f", {lfull['n']} full, {pp(lfull)}" if lfull and lfull["n"] else ""
    if share and share["n"]:
        locust += f"; Locust's CPU share of its worst lags {_f(share['p50'], 2)} (p50)"
    conn = (f"; without WebSocket connects ({sp['with_connect']} of the 429s included one) "
            f"{pp(sp['client_ms_after_connect'])}" if "client_ms_after_connect" in sp else "")
    return (f"{pp(sp['router_answer_ms'])}; {pp(sp['router_loop_lag_ms'])} (max {_f(sp['router_loop_lag_ms']['max'], 0)}); "
            f"{pp(sp['locust_loop_lag_ms'])} (max {_f(sp['locust_loop_lag_ms']['max'], 0)}); "
            f"router GC {gc_}{locust}; client by reason: "
            f"{reasons or 'none'}{conn}")


def _cores(srv: dict) -> str:
    by_role = srv.get("cores_by_role")
    if not by_role:
        return "n/a"
    parts = [f"{r} {v:.2f}" for r, v in by_role.items() if v >= 0.005]
    host = srv.get("host_cores") or {}
    states = f"; the host's: {', '.join(f'{k} {v:.2f}' for k, v in host.items() if v >= 0.005)}" if host else ""
    b = srv.get("background_bursts")
    bursts = (f"; the other processes' bursts: {b['cores']:.2f} cores for {b['length_s']:.2f} s every "
              f"{b['every_s']:.1f} s ({b['bursts']}), {b['steady_cores']:.2f} between") if b else ""
    return f"{srv['cores_total']:.2f} in all: " + ", ".join(parts) + states + bursts


def _rss(srv: dict) -> str:
    mb, growth = srv.get("rss_mb", {}), srv.get("rss_growth", {})
    return ", ".join(f"{r} {v:.0f} MB" + (f" ({growth[r]:+.1%})" if r in growth else "") for r, v in mb.items()) or "n/a"


def _draft(um: dict) -> str:
    if not um.get("devices"):
        return f"{um['draft_ms']:g} ms/forward"
    from loadtests.config import DEVICE_DRAFT_MS

    return ", ".join(f"{share:g} {d} ({DEVICE_DRAFT_MS[d]:g} ms/forward)" for d, share in um["devices"].items())


def _path(rp: dict | None) -> str:
    if not rp:
        return "Serve's HTTP proxy"
    return f"ingress {rp['ingress']}, throughput_optimized {'on' if rp['throughput_optimized'] else 'off'}"


FAULT_WINDOW_S = 60.0  # chaos: an open past its deadline this soon after a fault is counted apart


def fault_summary(counters: dict, events: list[dict], meta: dict, t0: float, tot) -> dict:
    """Node kills, returns and the GCS restart of a chaos run (the server's events), with what the users saw
    around them: tokens/s before each kill and the seconds until a 5-s mean held 90 % of it again, successful
    verify rounds while the GCS was down, and the outcomes the users retried or re-opened."""
    per_s = {s: sum(v.values()) for s, v in counters["tokens_by_second"].items()}
    last = max(per_s) if per_s else 0

    def recovery(at: float) -> dict:
        k = int(at)
        before = [per_s.get(x, 0) for x in range(k - 60, k)]
        base = sum(before) / len(before) if before else 0.0
        back = None
        for x in range(k, last - 4):
            if sum(per_s.get(y, 0) for y in range(x, x + 5)) / 5 >= 0.9 * base:
                back = x - at
                break
        return {"tokens_per_s_before": round(base, 1), "full_throughput_after_s": None if back is None
                else round(max(back, 0.0), 1)}

    ev = lambda name: [e for e in events if e.get("event") == name]  # noqa: E731
    kills = [{"t_s": round(e["t"] - t0, 1), "node": e.get("node"), "replicas": e.get("replicas"),
              "routers": e.get("routers"), **recovery(e["t"])} for e in ev("node_killed")]
    gk, gs = ev("gcs_killed"), ev("gcs_started")
    gcs: dict = {}
    if gk:
        k = gk[0]["killed_at"]
        s_ = gs[0]["started_at"] if gs else None
        at = [x for v in counters["verify_at"].values() for x in v]
        gcs = {"killed_at_s": round(k - t0, 1), "started_at_s": None if s_ is None else round(s_ - t0, 1),
               "down_s": None if s_ is None else round(s_ - k, 1),
               "verifies_ok_during_outage": sum(k <= x < (s_ or k) for x in at),
               "redis_keys": gk[0].get("redis_keys_before"), **recovery(k)}
    return {"sent": [(round(t - t0, 1), c) for t, c in meta.get("faults_sent", [])], "node_kills": kills,
            "nodes_back": [round(e["t"] - t0, 1) for e in ev("node_back")],
            "restored_after_s": [e["after_node_back_s"] for e in ev("replicas_restored")],
            "fault_errors": [e.get("error") for e in ev("fault_error")], "gcs": gcs,
            "retried": {"reopens": tot("reopens"), "superseded_404_410": tot("superseded"),
                        "lost_replies": tot("lost_replies"), "lost_open_replies": tot("lost_open_replies"),
                        "ws_reconnects": tot("reconnects"), "unavailable_503": tot("unavailable")}}


def fault_lines(f: dict) -> list[str]:
    lines = ["", "## Faults (multi-node cluster)", "",
             "| at (s) | fault | replicas / routers on it | tokens/s before | back to 90 % after (s) |",
             "|---|---|---|---|---|"]
    for k in f["node_kills"]:
        lines.append(f"| {k['t_s']} | worker node {k['node']} SIGKILLed | {k['replicas']} / {k['routers']} | "
                     f"{_f(k['tokens_per_s_before'])} | {_f(k['full_throughput_after_s'])} |")
    g = f["gcs"]
    if g:
        lines.append(f"| {g['killed_at_s']} | head's gcs_server SIGKILLed, restarted {g['down_s']} s later "
                     f"({g['verifies_ok_during_outage']:g} rounds answered meanwhile) | | "
                     f"{_f(g['tokens_per_s_before'])} | {_f(g['full_throughput_after_s'])} |")
    lines += ["", f"Nodes back at {f['nodes_back']} s; Serve back to the replica count {f['restored_after_s']} s "
                  f"after each. Retried by the users (not errors): {json.dumps(f['retried'])}."
              + (f" Fault errors: {f['fault_errors']}." if f["fault_errors"] else "")]
    return lines


def markdown(s: dict) -> str:
    lim, um, run = s["limits"], s["user_model"], s["run"]
    rv, vo = s.get("router_verify_ms_window") or {}, s.get("verify_outside_router_ms_window") or {}
    lines = [
        f"# Load test: {s['scenario']}",
        "",
        s["description"],
        "",
        f"- **Target**: `{s['target']}` ({s['server_model']}); **machine**: {s['machine']['cores']} cores "
        f"({s['machine']['platform']}), {s['machine']['note']}.",
        f"- **Limits**: {lim['verifier_replicas']} verifier replica(s), max_batch_sessions "
        f"{lim['max_batch_sessions']}, max_batch_tokens {lim['max_batch_tokens']}, batch_wait_ms "
        f"{lim['batch_wait_ms']}, max_tree_nodes {lim['max_tree_nodes']}, torch threads {lim['torch_threads']}, "
        f"router max_pending_verifies {lim['router_max_pending_verifies']}, max_queued_batches "
        f"{lim.get('router_max_queued_batches')}.",
        f"- **Users**: {run['users']} (spawn {run['spawn_rate']:g}/s, {run['duration_s']:g} s, "
        f"{s['locust_processes']} Locust process(es), app "
        f"{'started by the run' if run['started_app'] else 'at ' + run['host']}"
        f"{'' if run.get('worker_niceness') is None else ', its Ray workers at nice %d' % run['worker_niceness']}"
        f"{', Locust at nice %d' % run['client_niceness'] if run.get('client_niceness') else ''}"
        f"{' in a session of its own' if run.get('client_autogroup') else ''}); "
        f"draft {_draft(um)}, RTT {um['rtt_ms']:g} ms median (log-normal sigma {um.get('rtt_sigma', 0):g}, "
        f"±{um['jitter']:.0%} per round), {um.get('ws_share', 0):.0%} WebSocket users, "
        f"acceptance alpha={um['alpha']:g} sibling={um['sibling_alpha']:g}, depth "
        f"{um['depth'] or 'server hint'}, nodes {um['nodes'] or 'server hint'}, {um['max_tokens']} tokens per "
        f"generation, idle {um['idle_s'][0]:g}-{um['idle_s'][1]:g} s between generations.",
        f"- **Request path**: {_path(s.get('request_path'))}.",
        f"- **Steady-state window**: {s['window_s'][0]:g}-{s['window_s'][1]:g} s after Locust started.",
        "",
        "| metric | whole run | steady state |",
        "|---|---|---|",
        f"| requests/s (all) | {_f(s['requests_per_s'])} | |",
        f"| verify rounds/s | {_f(s['verify_per_s'])} | {_f(s['verify_per_s_window'])} |",
        f"| verify latency p50 / p95 / p99 (ms) | {_f(s['verify_ms']['p50'], 0)} / {_f(s['verify_ms']['p95'], 0)} / "
        f"{_f(s['verify_ms']['p99'], 0)} | {_f(s['verify_ms_window']['p50'], 0)} / "
        f"{_f(s['verify_ms_window']['p95'], 0)} / {_f(s['verify_ms_window']['p99'], 0)} |",
        f"| the same, the router's verifier call alone p50 / p95 / p99 (ms) | | "
        f"{_f(rv.get('p50'), 0)} / {_f(rv.get('p95'), 0)} / {_f(rv.get('p99'), 0)} |",
        f"| the same, outside the router (the users' less its Server-Timing) p50 / p99 (ms) | | "
        f"{_f(vo.get('p50'), 0)} / {_f(vo.get('p99'), 0)} |",
        f"| tokens/s served | {_f(s['tokens_per_s'])} | {_f(s['tokens_per_s_window'])} |",
        f"| 429 rate | {s['rate_429']:.2%} ({s['shed_429']:g}: {s['shed_reasons']}) | {s['rate_429_window']:.2%} |",
        f"| 429 latency p50 / p99 (ms) | {_f(s['shed_ms']['p50'], 0)} / {_f(s['shed_ms']['p99'], 0)} | "
        f"{_f(s['shed_ms_window']['p50'], 0)} / {_f(s['shed_ms_window']['p99'], 0)} |",
        f"| 429 where the time goes, p50 / p99 (ms): router's own answer; router loop lag; Locust loop lag | | "
        f"{_split(s.get('shed_split'))} |",
        f"| latency probe (loadtests/probe.py: one light client in its own process) p50 / p99 (ms) | | "
        f"{_probe_cell(s.get('probe'))} |",
        f"| admitted opens p50 / p99 (ms); past the {s['open_ms']['deadline_s']:g} s deadline | "
        f"{_f(s['open_ms']['p50'], 0)} / {_f(s['open_ms']['p99'], 0)}; {s['open_ms']['past_deadline']:g} | |",
        f"| opens refused for their deadline / of them while the verifier was idle | "
        f"{s.get('open_refusals', {}).get('deadline', 0):g} / {s.get('open_refusals', {}).get('while_idle')} | |",
        f"| where users wait: sessions held (the replicas' mean); users waiting out a Retry-After (mean, by the "
        f"request); the 429s' Retry-After p50 / max (s) | | {_waits(s.get('waits'))} |",
        f"| 503 (verifier restarting) / re-opens | {s['unavailable_503']:g} / {s['reopens']:g} | |",
        f"| WebSocket rounds lost with their connection (re-opened) | {sum(s.get('ws_lost', {}).values()):g} "
        f"{s.get('ws_lost') or ''} | |",
        f"| server cores used, by role | | {_cores(s['server'])} |",
        f"| Locust cores used (whole run) | {_f(s.get('locust_cores'), 2)} | |",
        f"| Locust cores used (steady window) | {_f(s.get('locust_cores_window'), 2)} | |",
        f"| verify rounds/s per core of each hop | | "
        f"{', '.join(f'{r} {_f(v, 0)}' for r, v in s.get('sizing', {}).items()) or 'n/a'} |",
        f"| RSS (MB) / growth over the window | | {_rss(s['server'])} |",
        f"| errors (non-429) | {s['errors'] + s['locust_failures']:g} {s['error_kinds'] or ''} | |",
        f"| sessions opened / closed (by the server as they finished) / superseded / unclosed | "
        f"{s['sessions']['opened']:g} / {s['sessions']['closed']:g} ({s['sessions'].get('closed_by_server', 0):g}) / "
        f"{s['sessions']['superseded']:g} / {s['sessions']['unclosed']:g} | |",
        f"| accepted nodes per round: measured / model | {_f(s['acceptance']['accepted_per_round'], 2)} / "
        f"{_f(s['acceptance']['model_expected_per_round'], 2)} ({_f(s['acceptance']['drafted_per_round'], 1)} "
        f"drafted, depth {_f(s['acceptance'].get('depth_per_round'), 1)}) | |",
        f"| rounds accepted other than the model / diverged sessions | "
        f"{s['acceptance']['rounds_accepted_other_than_model']:g} / {s['acceptance']['diverged_sessions']:g} | |",
    ]
    srv = s["server"]
    if srv.get("available"):
        lines.append(f"| verifier queue (mean) / batch sessions (mean) / busy | | {_f(srv['mean_pending'])} / "
                     f"{_f(srv['mean_batch_sessions'])} / {_f(100 * srv['busy_fraction'], 0)}% |")
        own = srv.get("replica_window")
        if own:
            lines.append(f"| the verifier's own time of a round, mean (its handler to its reply) / verify forwards a "
                         f"second / sessions a forward / a forward's CPU | | {_f(own['round_ms_mean'])} ms / "
                         f"{_f(own['verify_forwards_per_s'])} / {_f(own['sessions_per_forward'])} / "
                         f"{_f(own['forward_cpu_ms'], 2)} ms |")
    nsat = s.get("backlogged_seconds")
    lines += ["", "## Tenants (steady state)", "",
              "Token share = tokens served to the tenant / all tokens served, over the seconds of the window "
              "in which the verifier had a full batch waiting in every sample (also the second before and after)"
              + (f" ({nsat} s)" if nsat is not None else " (no verifier samples: the whole window)")
              + "; weights decide only then.", "",
              "| tenant | weight | users | tokens/s | token share (whole window) | token share (backlogged) | "
              "weight share | share / weight | verify p50 / p99 (ms) | 429 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for t, v in s["tenants"].items():
        lines.append(f"| {t} | {v['weight']:g} | {v['user_share']:.0%} | {_f(v['tokens_per_s'])} | "
                     f"{v['token_share_window']:.3f} | "
                     f"{v['token_share']:.3f} | {v['weight_share']:.3f} | {v['share_over_weight']:.2f} | "
                     f"{_f(v['verify_p50_ms'], 0)} / {_f(v['verify_p99_ms'], 0)} | {v['shed']:g} |")
    if "faults" in s:
        lines += fault_lines(s["faults"])
    lines += ["", "## Checks", ""]
    lines += [f"- {'PASS' if c['ok'] else 'FAIL'}: {c['name']} ({c['detail']})" for c in s["checks"]]
    lines += ["", "Plots: `throughput.png`, `latency.png`, `tenant_share.png`. Locust CSVs: `locust_*.csv`.", ""]
    return "\n".join(lines)


def _waits(w: dict | None) -> str:
    if not w:
        return "n/a"
    users = ", ".join(f"{k} {_f(v)}" for k, v in w["users_waiting_retry_after"].items()) or "none"
    told = ", ".join(f"{r} {_f(v['p50'], 1)} / {_f(v['max'], 1)}" for r, v in w["retry_after_s"].items()) or "none"
    return f"{_f(w['sessions_held'])}; {users}; {told}"


def plots(out: Path, s: dict, history: list[dict], counters: dict, t0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = [r for r in history if r.get("Name") == "Aggregated"]
    ver = [r for r in history if r.get("Name") == "verify"] or [r for r in history if r.get("Name") == "ws verify"]
    secs = sorted(counters["tokens_by_second"])
    fig, ax = plt.subplots(figsize=(8, 4))
    for t in s["tenants"]:
        ax.plot([x - t0 for x in secs], [counters["tokens_by_second"][x].get(t, 0) for x in secs],
                label=f"{t} tokens/s")
    if agg:
        ax2 = ax.twinx()
        ax2.plot([int(r["Timestamp"]) - t0 for r in agg], [int(r["User Count"]) for r in agg], "k--", label="users")
        ax2.set_ylabel("users")
    ax.axvspan(s["window_s"][0], s["window_s"][1], color="grey", alpha=0.1, label="steady state")
    for e in s["server"].get("events", []):
        if e.get("event") == "kill_verifier":
            ax.axvline(e["t"] - t0, color="red", label="verifier replica killed")
    ax.set_xlabel("s since start")
    ax.set_ylabel("tokens/s served")
    ax.set_title(f"{s['scenario']}: {s['run']['users']} users, {s['target']} target")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    rows = ver or agg
    for q in ("50%", "95%", "99%"):
        ax.plot([int(r["Timestamp"]) - t0 for r in rows], [_float(r[q]) for r in rows], label=f"verify {q}")
    ax.set_yscale("log")
    ax.set_xlabel("s since start")
    ax.set_ylabel("ms (Locust, 10 s window)")
    ax.set_title("verify latency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(s["tenants"])
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [s["tenants"][n]["token_share"] for n in names], 0.4, label="token share")
    ax.bar([x + 0.2 for x in xs], [s["tenants"][n]["weight_share"] for n in names], 0.4, label="weight share")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("share")
    ax.set_title("per-tenant share (steady state)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tenant_share.png", dpi=90)
    plt.close(fig)


def write_report(out: Path, cfg: LoadTestConfig, meta: dict, server_stats: Path | None) -> dict:
    s = summarize(out, cfg, meta, server_stats)
    (out / "summary.json").write_text(json.dumps(s, indent=2, default=str))
    (out / "report.md").write_text(markdown(s))
    try:
        plots(out, s, read_locust_history(out / "locust_stats_history.csv"),
              merge_counters(sorted(glob.glob(str(out / "counters.json*")))), meta["locust_started"])
    except ImportError:  # matplotlib is a dev extra
        pass
    return s


def console_line(s: dict) -> str:
    w = s["verify_ms_window"]
    return (f"[loadtests] {s['run']['users']} users: {s['requests_per_s']:.0f} req/s, verify p50/p95/p99 "
            f"{_f(w['p50'], 0)}/{_f(w['p95'], 0)}/{_f(w['p99'], 0)} ms, {s['tokens_per_s_window']:.0f} tokens/s, "
            f"429 {s['rate_429']:.1%}, errors {s['errors'] + s['locust_failures']:g}, unclosed "
            f"{s['sessions']['unclosed']:g}, checks "
            f"{'PASS' if all(c['ok'] for c in s['checks']) else 'FAIL'}")


def write_sweep(out: Path, cfg: LoadTestConfig, results: list[dict]) -> None:
    lines = [f"# Sweep: {cfg.name} on the {cfg.target} target", "",
             f"Held = steady-state p99 verify < {HELD_P99_MS:.0f} ms and at most {HELD_MAX_SHED:.0%} shed (429) in the "
             f"steady state, no errors. {results[0]['machine']['cores']} cores; every process of the test "
             f"(app, Locust) on them; "
             f"{results[-1]['machine']['note']}.", "",
             "| users | req/s | verify/s | verify p50 / p95 / p99 (ms) | tokens/s | 429 rate (steady / whole run) "
             "| errors | held |",
             "|---|---|---|---|---|---|---|---|"]
    for s in results:
        w = s["verify_ms_window"]
        lines.append(f"| {s['run']['users']} | {_f(s['requests_per_s'])} | {_f(s['verify_per_s_window'])} | "
                     f"{_f(w['p50'], 0)} / {_f(w['p95'], 0)} / {_f(w['p99'], 0)} | {_f(s['tokens_per_s_window'])} | "
                     f"{s.get('rate_429_window', float('nan')):.2%} / {s['rate_429']:.2%} | "
                     f"{s['errors'] + s['locust_failures']:g} | {'yes' if held(s) else 'no'} |")
    ok = [s["run"]["users"] for s in results if held(s)]
    lines += ["", f"Largest user count held: {max(ok) if ok else 'none of those tried'}.", ""]
    (out / "sweep.md").write_text("\n".join(lines))
    (out / "sweep.json").write_text(json.dumps([{"users": s["run"]["users"], "held": held(s), **{
        k: s[k] for k in ("requests_per_s", "verify_per_s_window", "verify_ms_window", "tokens_per_s_window",
                          "rate_429", "rate_429_window", "errors")}} for s in results], indent=2))
