"""``python -m sim validate``: the simulator's predictions next to measured served runs of the same
machine, with the error of each figure (issue 61).

Inputs, committed in ``sim/validation/``: cost profiles measured on the host
(``benchmarks.verify_step``: the embedded target, and the load tests' tiny one) and the served runs
measured there: ``benchmarks.run`` rows of ``server_ar`` and ``edge_full``, ``loadtests.run`` ramp
summaries (``loadtests/*.json``, each several runs of one command merged by :func:`record_loadtest`).
Each run is simulated with what the run itself reports of its conditions (sessions, generations,
RTT, the edge's draft depth, nodes and draft ms per forward, one shared edge core, proactive
drafting, its prompts' lengths), the acceptance fitted to its measured tokens per round; what it
does not report is a stated assumption (:data:`ASSUMED`). Each figure is predicted as its mean over
several seeds (a measured run is one draw). Targets: verified tokens/s, verify rounds/s and ITL p50
within 10 %, ITL p99 within 20 %.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from benchmarks.bursts import mean_cores
from deploy.config import AppConfig
from loadtests.synthetic_tree import AcceptanceModel, expected_accepted
from sim.cost_profile import CostProfile, HostCost
from sim.workload import Workload

HERE = Path(__file__).resolve().parent / "validation"
TARGETS = {"verified_tokens_per_s": 0.10, "verify_rounds_per_s": 0.10, "latency_ms_p50": 0.10, "latency_ms_p99": 0.20}
# a load test's also, where it measured them: an admitted verify round's verifier call as the router times it (the
# load generator's waits out); the round's time outside the router (the users' less the router's Server-Timing: the
# load generator's); the verifier's own time of a round (its counters', mean: its queue, batch wait, forwards, reply);
# the sessions the replicas hold (their samples' mean: what the depth hints rest on)
ROUTER_TARGETS = {"router_ms_p50": 0.10, "router_ms_p99": 0.20, "outside_ms_p50": 0.10, "outside_ms_p99": 0.20,
                  "verifier_ms_mean": 0.10, "sessions_held": 0.10}
# what the measured runs do not report; client_reply_share: the load generator's CPU a request spent reading its reply
ASSUMED = {"sibling_alpha": 0.3, "jitter": 0.0, "client_reply_share": 0.5}
ROUTER_PHASES = HERE / "router-phases.json"  # the router's reply_share and admit_share (benchmarks.router_phases)
# one benchmarks.run command, three times back to back
RUNS = ("bench-runs.json", "bench-runs-2.json", "bench-runs-3.json")
BURST_FIELDS = ("cores", "length_s", "every_s")  # of a run's background_bursts (benchmarks.bursts.BurstProfile)


def fit_alpha(tokens_per_round: float, depth: int, nodes: int, sibling: float) -> float:
    """The draft top-1 acceptance whose synthetic trees give ``tokens_per_round`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if 1.0 + expected_accepted(AcceptanceModel(mid, sibling), depth, budget=nodes) < tokens_per_round:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def bench_case(row: dict, conditions: dict) -> tuple[AppConfig, Workload]:
    """A ``benchmarks.run`` row as a deployment and a workload."""
    from benchmarks.run_plan import PLANS, app_config, prompt_ids

    plan = dataclasses.replace(PLANS["full"], modes=["server_ar", "edge_full"])
    app = app_config(plan, "ngram", 2)  # the run's deployment (the server drafter is idle in these modes)
    app["verifier"]["max_batch_sessions"] = max(16, max(int(r["sessions"]) for r in conditions["rows"]))
    app["target"].update(model="smollm2-135m", dtype="bfloat16")  # the embedded target's shape: no files needed
    sessions = int(row["sessions"])
    w = {"users": sessions, "duration_s": 3600.0, "warmup_s": 0.0, "max_tokens": int(conditions["max_tokens"]),
         # one repeat of the row (its repeats start their sessions together: the seeds stand for them)
         "generations_per_user": max(1, round(row["generations"] / int(row.get("repeats", 1)) / sessions)),
         "prompt_lengths": [len(p) for p in prompt_ids(plan, plan.prompts_for(sessions))[0]],  # the run's own
         "tenants": {"bench": 1.0},
         "network": {"rtt_ms": float(row["rtt_ms"]), "jitter": ASSUMED["jitter"]}}
    if row["mode"] == "server_ar":
        w["mode"] = "server_ar"
    else:  # the run's depth, and the tree its agent's builder made there, under the server's hints
        trees = max((r for r in conditions["rows"] if r["mode"] == row["mode"] and r["draft_depth_mean"]),
                    key=lambda r: r["draft_depth_mean"])  # the acceptance of the draft/target pair, where trees ran
        depth, nodes = int(conditions["fixed_depth"]), max(1, round(trees["sent_nodes_per_round"]))
        alpha = fit_alpha(trees["tokens_per_verify"], round(trees["draft_depth_mean"]), nodes, ASSUMED["sibling_alpha"])
        draft_ms = _known(row["draft_ms_per_forward"]) or trees["draft_ms_per_forward"]
        w.update(mode="edge", depth=depth, nodes=nodes, proactive=True, edge_workers=1,  # nodes: its builder's tree
                 devices={"bench-edge": 1.0}, draft_ms={"bench-edge": float(draft_ms)},
                 acceptance={"alpha": alpha, "sibling_alpha": ASSUMED["sibling_alpha"]})
    return AppConfig(**app), Workload(**w)


def _known(x):
    """A run's figure, None where it has none (JSON null, or NaN where nothing was measured)."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def measured(row: dict) -> dict:
    """A benchmarks.run row's figures (latency: the users' ITL)."""
    return {"verified_tokens_per_s": row["server_tokens_per_s"],
            "verify_rounds_per_s": row["server_tokens_per_s"] / row["tokens_per_verify"],
            "latency_ms_p50": row["itl_ms_p50"], "latency_ms_p99": row["itl_ms_p99"]}


def predicted(out: dict, latency: str = "itl_ms") -> dict:
    return {"verified_tokens_per_s": out["verified_tokens_per_s"], "verify_rounds_per_s": out["verify_rounds_per_s"],
            "latency_ms_p50": out[latency]["p50"], "latency_ms_p99": out[latency]["p99"],
            "router_ms_p50": out["router_verify_ms"]["p50"], "router_ms_p99": out["router_verify_ms"]["p99"],
            "outside_ms_p50": out["verify_outside_router_ms"]["p50"],
            "outside_ms_p99": out["verify_outside_router_ms"]["p99"],
            "verifier_ms_mean": (out.get("replica_window") or {}).get("round_ms_mean", float("nan")),
            "sessions_held": _nan(out.get("waits", {}).get("sessions_held"))}


def _nan(x) -> float:
    return float("nan") if x is None else x


def loadtest_case(run: dict) -> tuple[AppConfig, Workload]:
    """A ``loadtests.run`` summary (with its app and user model) as a deployment and a workload:
    the same users, spawn, think time, prompts, draft time, RTT, jitter and acceptance."""
    u, s = run["user_model"], run["summary"]
    users, spawn = int(s["run"]["users"]), float(s["run"]["spawn_rate"])
    start = s["window_s"][0]  # the report's steady window: after the spawn and its warm-up
    w = Workload(users=users, duration_s=s["window_s"][1], warmup_s=start, spawn_rate=spawn,
                 think_s=tuple(u["idle_s"]), prompt_tokens=tuple(run["prompt_len"]), max_tokens=u["max_tokens"],
                 client="loadtest", devices={"loadtest": 1.0}, draft_ms={"loadtest": u["draft_ms"]},
                 depth=u["depth"], nodes=u["nodes"], run_ahead=False,
                 tenants={t["name"]: 1.0 for t in run["app"]["router"]["tenants"]},
                 network={"rtt_ms": u["rtt_ms"], "rtt_sigma": u["rtt_sigma"], "jitter": u["jitter"]},
                 acceptance={"alpha": u["alpha"], "sibling_alpha": u["sibling_alpha"]})
    return AppConfig(**run["app"]), w


def host_from_loadtest(run: dict, source: str = "") -> HostCost:
    """The host's CPU per request in a load test's steady window (CPU seconds by process over its
    requests): the router's over every request (verifies, opens and the client's closes, and the
    429s, each at the share the simulation charges one: its admission's, ``HostCost.router_parts_s``),
    the verifier's outside its forwards' CPU over the requests that reach it (no 429), the load
    generator's over every request (Locust's own, ``locust_cores_window``; older runs: the rest
    of the host's cores). ``cores``: the host's busy cores (``host_cores``, /proc/stat; older runs:
    all of them): at saturation the served system leaves the rest idle, its threads waiting on hand-
    offs the simulation does not model, which keeps its cores busy whenever two processes have work.
    The other processes' (Ray's agents, GCS, controller, proxy) are background, steady and in their
    measured bursts (:func:`_background`); the reply's share (:data:`ASSUMED`)."""
    s = run["summary"]
    roles, cores = s["server"]["cores_by_role"], float(s["machine"]["cores"])
    host = s["server"].get("host_cores")
    busy = cores - host["idle"] - host["iowait"] if host else cores
    sessions_per_s = (2 * s["sessions"]["opened"] - s["sessions"]["closed_by_server"]) / s["run"]["duration_s"]
    per_s = s["verify_per_s_window"] / (1.0 - s["rate_429_window"]) + sessions_per_s
    admitted_per_s = s["verify_per_s_window"] + sessions_per_s
    background = sum(v for k, v in roles.items() if k not in ("router", "verifier"))
    client = s.get("locust_cores_window")
    if client is None:
        client = cores - roles["router"] - roles["verifier"] - background
    forwards = s["server"].get("forward_cpu_cores", s["server"]["busy_fraction"])  # older runs: the forwards' wall
    # a 429 costs the router what the simulation charges it (HostCost.router_parts_s: its admission's share)
    shares = router_shares()
    shed_share = HostCost(router_s=1.0, **shares).router_parts_s[0]
    router_s = roles["router"] / (admitted_per_s + shed_share * (per_s - admitted_per_s))
    return HostCost(router_s=router_s, replica_s=(roles["verifier"] - forwards) / admitted_per_s,
                    client_s=max(0.0, client) / per_s, cores=busy, **shares,
                    client_reply_share=ASSUMED["client_reply_share"], client_weight=client_weight(s["run"]),
                    source=source,
                    **_background(background, s["server"].get("background_bursts")))


def router_shares(path: Path = ROUTER_PHASES) -> dict:
    """``HostCost.reply_share`` and ``admit_share`` as measured on the served router
    (``python -m benchmarks.router_phases``)."""
    d = json.loads(path.read_text())
    return {"reply_share": float(d["reply_share"]), "admit_share": float(d["admit_share"])}


def client_weight(run: dict) -> float:
    """The load generator's claim on the cores against a server process's (``HostCost.client_weight``):
    Linux shares the CPU between sessions (autogroups) by their nice before their threads, so a
    Locust in a session of its own at nice n (``client_autogroup``) claims 1.25 ** -n of the
    server's session; in a shared session it is one thread among the server's."""
    return 1.25 ** -run.get("client_niceness", 0) if run.get("client_autogroup") else 1.0


def host_from_bench(run: dict, source: str = "") -> HostCost:
    """The replica's CPU outside the model in a ``benchmarks.run`` (its CPU split per token, the
    server on one core): per request and per forward from ``server_ar`` at its fewest and most
    sessions (one token a request, forwards per token measured), more per tree request from
    ``edge_full`` at its fewest (:func:`bench_fit_rows`); Serve's proxy and Ray's other processes as
    background cores, steady and in their measured bursts (:func:`_background`)."""
    rows = run["rows"]
    lo, hi, edge = bench_fit_rows(rows)
    per_forward = ((lo["cpu_ms_per_token_verifier_other"] - hi["cpu_ms_per_token_verifier_other"])
                   / (lo["verify_forwards_per_token"] - hi["verify_forwards_per_token"]))
    per_request = lo["cpu_ms_per_token_verifier_other"] - per_forward * lo["verify_forwards_per_token"]
    tree = ((edge["cpu_ms_per_token_verifier_other"] - per_forward * edge["verify_forwards_per_token"])
            * edge["tokens_per_verify"] - per_request)
    background = sum((r["cpu_ms_per_token_proxy"] + r["cpu_ms_per_token_background"]) * r["server_tokens_per_s"]
                     for r in rows) / len(rows) / 1e3
    return HostCost(replica_s=per_request / 1e3, replica_tree_s=max(0.0, tree) / 1e3, forward_s=per_forward / 1e3,
                    cores=1.0, source=source, **_background(background, run["conditions"].get("background_bursts")))


def _background(cores: float, bursts: dict | None) -> dict:
    """HostCost's background from a run's other processes' mean ``cores`` and their bursts
    (``benchmarks.bursts.BurstProfile``; None: not measured): the steady part is what the bursts
    leave of the mean."""
    if not bursts:
        return {"background_cores": cores}
    return {"background_cores": max(0.0, cores - mean_cores(bursts)),
            "burst_cores": bursts["cores"], "burst_s": bursts["length_s"], "burst_every_s": bursts["every_s"]}


def bench_fit_rows(rows: list[dict]) -> tuple[dict, dict, dict]:
    """The rows :func:`host_from_bench` fits to: ``server_ar`` at its fewest and most sessions,
    ``edge_full`` at its fewest."""
    ar = sorted((r for r in rows if r["mode"] == "server_ar"), key=lambda r: r["sessions"])
    return ar[0], ar[-1], min((r for r in rows if r["mode"] == "edge_full"), key=lambda r: r["sessions"])


def loadtest_measured(s: dict) -> dict:
    """A load test's steady-window figures (latency: an admitted verify round, as its users time it; with
    the router's probe, its verifier call as the router times it; with its Server-Timing, the round's
    time outside the router; with the verifier's counters, its own time of a round; with its samples, the
    sessions the replicas hold)."""
    router, outside = s.get("router_verify_ms_window") or {}, s.get("verify_outside_router_ms_window") or {}
    own, held = s["server"].get("replica_window") or {}, (s.get("waits") or {}).get("sessions_held")
    return {"verified_tokens_per_s": s["tokens_per_s_window"], "verify_rounds_per_s": s["verify_per_s_window"],
            "latency_ms_p50": s["verify_ms_window"]["p50"], "latency_ms_p99": s["verify_ms_window"]["p99"],
            **({"router_ms_p50": router["p50"], "router_ms_p99": router["p99"]} if router.get("n") else {}),
            **({"outside_ms_p50": outside["p50"], "outside_ms_p99": outside["p99"]} if outside.get("n") else {}),
            **({"verifier_ms_mean": own["round_ms_mean"]} if own else {}),
            **({"sessions_held": held} if held is not None else {})}


def merge_runs(paths: list[Path]) -> dict:
    """Runs of one ``benchmarks.run`` command: each row's figures as their mean over the runs (a
    figure the runs agree on, such as the sessions, as it is), and in ``spread`` the runs' spread of
    each validated figure, (max - min) / mean."""
    runs = [json.loads(Path(p).read_text()) for p in paths]

    def key(r: dict) -> tuple:
        return r["mode"], r["rtt_ms"], r["sessions"]

    rows = []
    for row in runs[0]["rows"]:
        same = [next((r for r in run["rows"] if key(r) == key(row)), None) for run in runs]
        if None in same:
            missing = paths[same.index(None)]
            raise ValueError(f"{missing}: no row {key(row)}: the runs to merge must be of the same command")
        merged = {k: statistics.fmean(r[k] for r in same) if _number(v) and len({r[k] for r in same}) > 1 else v
                  for k, v in row.items()}
        figs = {f: [measured(r)[f] for r in same] for f in TARGETS}
        merged["spread"] = _spreads(figs)
        rows.append(merged)
    bursts = [b for run in runs if (b := run["conditions"].get("background_bursts"))]
    mean_bursts = {k: statistics.fmean(b[k] for b in bursts) for k in BURST_FIELDS} if bursts else None
    return {"conditions": {**runs[0]["conditions"], "runs": [run["conditions"].get("run") for run in runs],
                           "background_bursts": mean_bursts}, "rows": rows}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _compare(case: str, m: dict, runs: list[dict], spread: dict | None = None) -> list[dict]:
    """Each figure measured (of :data:`TARGETS`, and :data:`ROUTER_TARGETS` where measured) against its mean
    over the simulated seeds ``runs`` (with their spread: the population standard deviation over the mean);
    ``spread``: the measured runs' own, by figure."""
    out = []
    for fig, target in {**TARGETS, **{f: t for f, t in ROUTER_TARGETS.items() if f in m}}.items():
        values = [r[fig] for r in runs]
        p = statistics.fmean(values)
        err = (p - m[fig]) / m[fig] if m[fig] else float("nan")
        out.append({"case": case, "figure": fig, "measured": m[fig], "predicted": p, "error": err,
                    "seed_spread": statistics.pstdev(values) / p if p else float("nan"), "seeds": len(runs),
                    "measured_spread": (spread or {}).get(fig), "target": target,
                    "ok": not math.isnan(err) and abs(err) <= target})
    return out


def validate(profile_path: Path, runs_paths: list[Path], seed: int = 0, loadtests: list[Path] = (),
             tiny_profile: Path | None = None, host_run: Path | None = None,
             bench_host_runs: list[Path] | None = None, seeds: int = 1) -> list[dict]:
    """The benchmark rows of ``runs_paths`` (runs of one command, merged: :func:`merge_runs`;
    latency: ITL) and the load tests (latency: a verify round), each predicted from its profile as
    the mean over ``seeds`` seeds from ``seed`` (a measured run is one draw of what the simulation
    draws many of); the host's CPU outside the model fitted to ``bench_host_runs``
    (:func:`host_from_bench`; None: the runs themselves, ``[]``: the forward alone) and ``host_run``
    (:func:`host_from_loadtest`; None: the forward alone)."""
    from sim.__main__ import simulate

    table = []
    if runs_paths:
        table += _bench_table(CostProfile.load(profile_path), runs_paths, bench_host_runs, seed, seeds)
    host = host_from_loadtest(json.loads(host_run.read_text()), str(host_run)) if host_run else HostCost()
    for path in loadtests:
        run = json.loads(Path(path).read_text())
        app, workload = loadtest_case(run)
        outs = [predicted(simulate(app, CostProfile.load(tiny_profile), workload, k, host), "verify_ms")
                for k in range(seed, seed + seeds)]
        fitted = " (host fitted here)" if host_run and Path(path).resolve() == host_run.resolve() else ""
        case = f"loadtests.run ramp {run['summary']['run']['users']} users (verify round){fitted}"
        table += _compare(case, loadtest_measured(run["summary"]), outs, run["summary"].get("spread"))
    return table


def _bench_table(profile: CostProfile, runs_paths: list[Path], bench_host_runs: list[Path] | None, seed: int,
                 seeds: int) -> list[dict]:
    """:func:`validate`'s benchmark rows."""
    from sim.__main__ import simulate

    runs = merge_runs(runs_paths)
    own = bench_host_runs is None
    bench_host_data = runs if own else merge_runs(bench_host_runs) if bench_host_runs else None
    bench_host = host_from_bench(bench_host_data, ",".join(map(str, bench_host_runs or runs_paths))) \
        if bench_host_data else HostCost()
    fitted_rows = [id(r) for r in bench_fit_rows(runs["rows"])] if own else []
    table = []
    for row in runs["rows"]:
        app, workload = bench_case(row, {**runs["conditions"], "rows": runs["rows"]})
        outs = [predicted(simulate(app, profile, workload, k, bench_host)) for k in range(seed, seed + seeds)]
        case = f"benchmarks.run {row['mode']} {row['sessions']} sess RTT {row['rtt_ms']:g} ms (ITL)" + (
            " (host fitted here)" if id(row) in fitted_rows else "")
        table += _compare(case, measured(row), outs, row.get("spread"))
    return table


def record_loadtest(out_dirs: list[Path], dest: Path) -> None:
    """Keep what validation needs of ``loadtests.run`` output folders, runs of one command: their
    summaries merged (:func:`merge_loadtests`), the app, user model and prompt lengths (a few KB)."""
    keep = ("scenario", "target", "machine", "run", "window_s", "tokens_per_s_window", "verify_per_s_window",
            "verify_ms_window", "router_verify_ms_window", "verify_outside_router_ms_window", "rate_429_window",
            "errors", "sessions", "acceptance", "server", "locust_cores_window", "waits")
    summaries, configs = [], []
    for out_dir in out_dirs:
        s = json.loads((out_dir / "summary.json").read_text())
        summary = {k: s[k] for k in keep if k in s}
        summary["server"] = {k: v for k, v in s["server"].items()
                             if k in ("cores_by_role", "cores_total", "host_cores", "busy_fraction",
                                      "forward_cpu_cores", "mean_pending", "background_bursts", "replica_window")}
        summaries.append(summary)
        configs.append(json.loads((out_dir / "loadtest_config.json").read_text()))
    cfg = configs[0]
    if any((c["app"], c["user"], c["workload"]["prompt_len"]) != (cfg["app"], cfg["user"], cfg["workload"]["prompt_len"])
           for c in configs):
        raise ValueError("the load tests to merge must be runs of one command")
    dest.write_text(json.dumps({"summary": merge_loadtests(summaries), "app": cfg["app"], "user_model": cfg["user"],
                                "prompt_len": cfg["workload"]["prompt_len"]}, indent=1))


def merge_loadtests(summaries: list[dict]) -> dict:
    """Load-test summaries of one command: every number their mean (as :func:`merge_runs` a benchmark's
    rows), with ``runs`` and each validated figure's spread across them, (max - min) / mean."""
    def mean(values: list):
        values = [v for v in values if v is not None] or [None]  # a figure some runs lack (no bursts)
        if isinstance(values[0], dict):
            return {k: mean([v[k] for v in values if k in v]) for k in values[0]}
        if all(_number(v) for v in values) and len(set(values)) > 1:
            return statistics.fmean(values)
        return values[0]

    merged = mean(summaries)
    measured = [loadtest_measured(s) for s in summaries]
    figs = {f: [m[f] for m in measured] for f in measured[0] if all(f in m for m in measured)}
    merged["runs"] = len(summaries)
    merged["spread"] = _spreads(figs)
    return merged


def _spreads(figs: dict[str, list[float]]) -> dict[str, float]:
    """Each figure's spread across the runs, (max - min) / mean."""
    return {f: (max(v) - min(v)) / statistics.fmean(v) for f, v in figs.items()}


def markdown(table: list[dict]) -> str:
    lines = ["| case | figure | measured (runs' spread) | predicted (seed spread) | error | target | |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        ms = f" ({100 * r['measured_spread']:.1f} %)" if r.get("measured_spread") is not None else ""
        lines.append(f"| {r['case']} | {r['figure']} | {r['measured']:.1f}{ms} | {r['predicted']:.1f} "
                     f"({100 * r['seed_spread']:.1f} %) | {100 * r['error']:+.1f} % | ±{100 * r['target']:.0f} % | "
                     f"{'ok' if r['ok'] else 'MISSED'} |")
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="predicted vs measured served runs of this machine")
    p.add_argument("--profile", default=str(HERE / "verify-step-cpu.json"))
    p.add_argument("--runs", default=",".join(str(HERE / f) for f in RUNS),
                   help="comma-separated runs of one benchmarks.run command, merged (each figure their mean)")
    p.add_argument("--loadtests", default=",".join(str(x) for x in sorted((HERE / "loadtests").glob("*.json"))),
                   help="comma-separated load-test runs (sim/validation/loadtests/*.json)")
    p.add_argument("--tiny-profile", default=str(HERE / "verify-step-tiny-cpu.json"),
                   help="the load tests' target's cost profile")
    p.add_argument("--bench-host-from", default=None,
                   help="comma-separated benchmarks.run runs whose CPU split (server_ar at its fewest and most "
                        "sessions, edge_full at its fewest) the benchmark rows are predicted with: --runs by "
                        "default; '' for the forward alone")
    p.add_argument("--host-from", default=str(HERE / "loadtests" / "ramp-300.json"),
                   help="the load test whose CPU per request (router, replica, client) the load tests are "
                        "predicted with; '' for the forward alone")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--seeds", type=int, default=5, help="each case predicted as the mean over this many seeds")
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    p.add_argument("--check", action="store_true", help="exit 1 if a figure misses its target")


def main(args) -> int:
    loadtests = [Path(x) for x in args.loadtests.split(",") if x]
    bench_host = None if args.bench_host_from is None else [Path(x) for x in args.bench_host_from.split(",") if x]
    table = validate(Path(args.profile), [Path(x) for x in args.runs.split(",") if x], args.seed, loadtests,
                     Path(args.tiny_profile), Path(args.host_from) if args.host_from else None, bench_host,
                     max(1, args.seeds))
    print(markdown(table))
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))
    missed = [r for r in table if not r["ok"]]
    print(f"\n{len(table) - len(missed)} of {len(table)} figures within target")
    return 1 if args.check and missed else 0
