"""``python -m sim plan``: how many verifier replicas N edge users need under SLOs, edge-drafted and
server-only, from the simulated served system (issue 61).

Sessions spread evenly over replicas (the affinity router sends each open to the least-loaded
one), so a replica with its share of the users behaves as the whole fleet does: the planner
searches the most users one replica serves within the SLOs (TTFT p99, ITL p99, verify p99, at
most ``max_shed`` of requests shed), by simulating one replica, and divides. It prints the
replicas (and GPUs) per user count and mode, the tokens per GPU-second, and writes a PNG of
throughput, ITL p50/p99 and TTFT p99 against users, both modes. Cross-replica effects (the
router's own limits, uneven affinity) are not in this shortcut.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from sim.cost_profile import CostProfile
from sim.workload import Workload


@dataclass(frozen=True)
class Slo:
    ttft_p99_ms: float
    itl_p99_ms: float
    verify_p99_ms: float
    max_shed: float = 0.01

    def misses(self, out: dict) -> list[str]:
        """The SLOs ``out`` (a simulation summary) misses, by name."""
        checks = {"ttft_p99_ms": out["ttft_ms_p99"] <= self.ttft_p99_ms,
                  "itl_p99_ms": out["itl_ms"]["p99"] <= self.itl_p99_ms,
                  "verify_p99_ms": out["verify_ms"]["p99"] <= self.verify_p99_ms,
                  "max_shed": out["shed_fraction"] <= self.max_shed,
                  "lossless": out["diverged_rounds"] == 0 and out["errors"] == 0}
        return [k for k, ok in checks.items() if not ok]


MEANS = ("verified_tokens_per_s", "verify_rounds_per_s", "tokens_per_round", "ttft_ms_mean", "ttft_ms_p99",
         "shed_fraction", "shed_429")  # averaged over a point's seeds
WORST = ("diverged_rounds", "errors")  # the most of any seed


def over_seeds(outs: list[dict]) -> dict:
    """One point's summary over its seeds: the first seed's, with each SLO figure and the throughput
    figures as their mean over the seeds (a p99 over one short run is a handful of samples) and the lossless
    counts as their worst."""
    out = dict(outs[0], seeds=len(outs))
    for k in MEANS:
        out[k] = sum(o[k] for o in outs) / len(outs)
    for k in ("itl_ms", "verify_ms"):
        out[k] = {q: sum(o[k][q] for o in outs) / len(outs) for q in ("p50", "p99")}
    for k in WORST:
        out[k] = max(o[k] for o in outs)
    return out


def per_replica(app, profile: CostProfile, workload: Workload, slo: Slo, seed: int, hi: int,
                seeds: int = 1) -> tuple[int, dict, list]:
    """The most users one replica serves within ``slo`` (doubling, then bisection, up to ``hi``);
    with the summary at that count and every point simulated, each over ``seeds`` seeds from
    ``seed`` (:func:`over_seeds`). Doubling goes on past points that miss before any has passed
    (lone sessions may draft deeper than a loaded replica lets them: ITL can improve with load)
    until one passes, or the replica sheds (overloaded)."""
    from sim.__main__ import simulate

    one = app.model_copy(deep=True)
    one.verifier.num_replicas = 1
    known: dict[int, dict] = {}  # users -> summary, in the order simulated

    def ok(users: int) -> tuple[bool, dict]:
        if users not in known:
            ramp = {"users": users, "spawn_rate": users / max(1.0, workload.warmup_s)}  # all spawned in the warm-up
            w = workload.model_copy(update=ramp)
            known[users] = over_seeds([simulate(one, profile, w, k) for k in range(seed, seed + seeds)])
        return not slo.misses(known[users]), known[users]

    good, good_out = 0, None
    n = max(1, min(hi, 8))
    while n <= hi:
        passed, out = ok(n)
        if passed:
            good, good_out = n, out
        elif good or "max_shed" in slo.misses(out):
            break
        n *= 2
    lo, top = good, min(n, hi + 1)
    while top - lo > max(1, lo // 16):  # to within ~6 %
        mid = (lo + top) // 2
        passed, out = ok(mid)
        lo, top, good_out = (mid, top, out) if passed else (lo, mid, good_out)
    return lo, good_out, list(known.items())


def gpus_per_replica(app) -> float:
    vc = app.verifier
    return max(vc.num_gpus_per_stage, 0.0) * vc.pipeline_parallel_size or 1.0


def plan(app, profile: CostProfile, workload: Workload, slo: Slo, users: list[int], seed: int = 0,
         seeds: int = 1) -> dict:
    profile.check(app.target.model, app.target.dtype if app.target.dtype != "auto" else profile.dtype)
    gpus = gpus_per_replica(app)
    modes = {}
    for mode in ("edge", "server_ar"):
        w = workload.model_copy(update={"mode": mode})
        cap, at_cap, points = per_replica(app, profile, w, slo, seed, hi=max(users), seeds=seeds)
        rows = []
        for n in users:
            replicas = math.ceil(n / cap) if cap else None
            rows.append({"users": n, "replicas": replicas, "gpus": replicas * gpus if replicas else None})
        modes[mode] = {"users_per_replica": cap, "at_capacity": at_cap, "by_users": rows,
                       "tokens_per_gpu_s": at_cap["verified_tokens_per_s"] / gpus if at_cap else 0.0,
                       "points": [(u, {k: o[k] for k in ("verified_tokens_per_s", "itl_ms", "verify_ms", "ttft_ms_p99",
                                                        "shed_429")}) for u, o in points]}
    return {"slo": slo.__dict__, "seeds": seeds, "profile": profile.source, "device": profile.device,
            "gpus_per_replica": gpus, "workload": workload.model_dump(mode="json"), "modes": modes}


def markdown(p: dict) -> str:
    lines = [f"SLOs: {p['slo']}; profile {p['profile']} ({p['device']}); "
             f"{p['gpus_per_replica']:g} GPU(s) per replica; each point the mean over {p.get('seeds', 1)} seed(s)",
             "",
             "| users | edge-drafted replicas | server-only replicas |", "|---|---|---|"]
    e, s = p["modes"]["edge"], p["modes"]["server_ar"]
    for a, b in zip(e["by_users"], s["by_users"]):
        lines.append(f"| {a['users']:,} | {a['replicas']} | {b['replicas']} |")
    lines += ["", "| mode | users per replica | verified tokens per GPU-second | ITL p50 / p99 (ms) at capacity |",
              "|---|---|---|---|"]
    for name, m in (("edge-drafted", e), ("server-only", s)):
        o = m["at_capacity"] or {"itl_ms": {"p50": float("nan"), "p99": float("nan")}}
        lines.append(f"| {name} | {m['users_per_replica']:,} | {m['tokens_per_gpu_s']:.0f} | "
                     f"{o['itl_ms']['p50']:.1f} / {o['itl_ms']['p99']:.1f} |")
    return "\n".join(lines)


def plot(p: dict, path: Path) -> None:
    """Throughput (tokens/s per replica), ITL p50/p99 and TTFT p99 against users per replica, both modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    for mode, style, color in (("edge", "-o", "tab:blue"), ("server_ar", "--s", "tab:orange")):
        pts = sorted(p["modes"][mode]["points"])
        xs = [u for u, _ in pts]
        a.plot(xs, [o["verified_tokens_per_s"] for _, o in pts], style, color=color, label=mode)
        b.plot(xs, [o["itl_ms"]["p50"] for _, o in pts], style, color=color, label=f"{mode} p50")
        b.plot(xs, [o["itl_ms"]["p99"] for _, o in pts], style, color=color, alpha=0.4, label=f"{mode} p99")
        c.plot(xs, [o["ttft_ms_p99"] for _, o in pts], style, color=color, label=mode)
    b.axhline(p["slo"]["itl_p99_ms"], color="grey", lw=0.8, ls=":", label="ITL p99 SLO")
    c.axhline(p["slo"]["ttft_p99_ms"], color="grey", lw=0.8, ls=":", label="TTFT p99 SLO")
    a.set(xlabel="users per replica", ylabel="verified tokens/s per replica", xscale="log")
    b.set(xlabel="users per replica", ylabel="ITL (ms)", xscale="log", yscale="log")
    c.set(xlabel="users per replica", ylabel="TTFT p99 (ms)", xscale="log")
    a.legend(), b.legend(fontsize=7), c.legend(fontsize=7)
    fig.suptitle(f"{p['device']}: one replica, simulated")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="replicas per user count within SLOs, edge-drafted and server-only")
    p.add_argument("--config", default="deploy/config.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    p.add_argument("--profile", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--users", default="5000,20000,100000", help="comma-separated user counts")
    p.add_argument("--slo-ttft-p99-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-p99-ms", type=float, default=80.0)
    p.add_argument("--slo-verify-p99-ms", type=float, default=500.0)
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--seeds", type=int, default=3, help="each point's SLO figures: their mean over this many seeds")
    p.add_argument("--out-dir", default=None, help="write plan.json, plan.md and plan.png here")


def main(args) -> int:
    from sim.__main__ import load_app

    app = load_app(args.config, args.set)
    users = [int(x) for x in args.users.split(",") if x.strip()]
    if not users or min(users) < 1:
        raise ValueError(f"--users {args.users!r}: positive counts, comma-separated")
    p = plan(app, CostProfile.load(args.profile), Workload.load(args.workload),
             Slo(args.slo_ttft_p99_ms, args.slo_itl_p99_ms, args.slo_verify_p99_ms), users, args.seed,
             max(1, args.seeds))
    text = markdown(p)
    print(text)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(p, indent=1))
        (out / "plan.md").write_text(text + "\n")
        plot(p, out / "plan.png")
        print(f"\nwrote {out / 'plan.json'}, plan.md, plan.png")
    return 0
