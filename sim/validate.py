"""``python -m sim validate``: the simulator's predictions next to measured served runs of the same
machine, with the error of each figure (issue 61).

Inputs, committed in ``sim/validation/``: a cost profile measured on the host
(``benchmarks.verify_step``) and the served runs measured there (``benchmarks.run`` rows of
``server_ar`` and ``edge_full``). Each run is simulated with what the run itself reports of its
conditions (sessions, generations, RTT, the edge's draft depth, nodes and draft ms per forward,
one shared edge core, proactive drafting), the acceptance fitted to its measured tokens per
round; what it does not report is a stated assumption (:data:`ASSUMED`). Targets: verified
tokens/s, verify rounds/s and ITL p50 within 10 %, ITL p99 within 20 %.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from deploy.config import AppConfig
from loadtests.synthetic_tree import AcceptanceModel, expected_accepted
from sim.cost_profile import CostProfile
from sim.workload import Workload

HERE = Path(__file__).resolve().parent / "validation"
TARGETS = {"verified_tokens_per_s": 0.10, "verify_rounds_per_s": 0.10, "itl_ms_p50": 0.10, "itl_ms_p99": 0.20}
ASSUMED = {"prompt_tokens": (64, 256), "sibling_alpha": 0.3, "jitter": 0.0}


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
    from benchmarks.run_plan import PLANS, app_config

    plan = dataclasses.replace(PLANS["full"], modes=["server_ar", "edge_full"])
    app = app_config(plan, "ngram", 2)  # the run's deployment (the server drafter is idle in these modes)
    app["verifier"]["max_batch_sessions"] = max(16, max(int(r["sessions"]) for r in conditions["rows"]))
    app["target"].update(model="smollm2-135m", dtype="bfloat16")  # the embedded target's shape: no files needed
    sessions = int(row["sessions"])
    w = {"users": sessions, "duration_s": 3600.0, "warmup_s": 0.0, "max_tokens": int(conditions["max_tokens"]),
         "generations_per_user": max(1, round(row["generations"] / sessions)),
         "prompt_tokens": ASSUMED["prompt_tokens"], "tenants": {"bench": 1.0},
         "network": {"rtt_ms": float(row["rtt_ms"]), "jitter": ASSUMED["jitter"]}}
    if row["mode"] == "server_ar":
        w["mode"] = "server_ar"
    else:  # the run's fixed depth; its tree budget from the server's hints, as the agent takes it
        trees = max((r for r in conditions["rows"] if r["mode"] == row["mode"] and r["draft_depth_mean"]),
                    key=lambda r: r["draft_depth_mean"])  # the acceptance of the draft/target pair, where trees ran
        depth = int(conditions["fixed_depth"])
        alpha = fit_alpha(trees["tokens_per_verify"], round(trees["draft_depth_mean"]),
                          max(1, round(trees["sent_nodes_per_round"])), ASSUMED["sibling_alpha"])
        draft_ms = row["draft_ms_per_forward"] or trees["draft_ms_per_forward"]
        w.update(mode="edge", depth=depth, proactive=True, edge_workers=1, devices={"bench-edge": 1.0},
                 draft_ms={"bench-edge": float(draft_ms)},
                 acceptance={"alpha": alpha, "sibling_alpha": ASSUMED["sibling_alpha"]})
    return AppConfig(**app), Workload(**w)


def measured(row: dict) -> dict:
    return {"verified_tokens_per_s": row["server_tokens_per_s"],
            "verify_rounds_per_s": row["server_tokens_per_s"] / row["tokens_per_verify"],
            "itl_ms_p50": row["itl_ms_p50"], "itl_ms_p99": row["itl_ms_p99"]}


def predicted(out: dict) -> dict:
    return {"verified_tokens_per_s": out["verified_tokens_per_s"], "verify_rounds_per_s": out["verify_rounds_per_s"],
            "itl_ms_p50": out["itl_ms"]["p50"], "itl_ms_p99": out["itl_ms"]["p99"]}


def validate(profile_path: Path, runs_path: Path, seed: int = 0) -> list[dict]:
    from sim.__main__ import simulate

    profile = CostProfile.load(profile_path)
    runs = json.loads(runs_path.read_text())
    table = []
    for row in runs["rows"]:
        app, workload = bench_case(row, {**runs["conditions"], "rows": runs["rows"]})
        out = simulate(app, profile, workload, seed)
        m, p = measured(row), predicted(out)
        for fig, target in TARGETS.items():
            err = (p[fig] - m[fig]) / m[fig] if m[fig] else float("nan")
            table.append({"case": f"{row['mode']} {row['sessions']} sess RTT {row['rtt_ms']:g} ms", "figure": fig,
                          "measured": m[fig], "predicted": p[fig], "error": err, "target": target,
                          "ok": not math.isnan(err) and abs(err) <= target})
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| case | figure | measured | predicted | error | target | |", "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['case']} | {r['figure']} | {r['measured']:.1f} | {r['predicted']:.1f} | "
                     f"{100 * r['error']:+.1f} % | ±{100 * r['target']:.0f} % | {'ok' if r['ok'] else 'MISSED'} |")
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="predicted vs measured served runs of this machine")
    p.add_argument("--profile", default=str(HERE / "verify-step-cpu.json"))
    p.add_argument("--runs", default=str(HERE / "bench-runs.json"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    p.add_argument("--check", action="store_true", help="exit 1 if a figure misses its target")


def main(args) -> int:
    table = validate(Path(args.profile), Path(args.runs), args.seed)
    print(markdown(table))
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))
    missed = [r for r in table if not r["ok"]]
    print(f"\n{len(table) - len(missed)} of {len(table)} figures within target")
    return 1 if args.check and missed else 0
