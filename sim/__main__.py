"""``python -m sim``: the served system in virtual time (issue 61; docs/simulation.md).

    python -m sim run --config deploy/config.yaml --profile sim/validation/verify-step-cpu.json \\
        --workload sim/workloads/edge-16.yaml [--seed 0] [--set verifier.num_replicas=4] [--out run.json]
    python -m sim validate [--check]        # predicted vs measured runs of this machine
    python -m sim plan --config ... --profile ... --workload ... --slo-itl-p99-ms 80 [--users 5000,20000]
    python -m sim paper                     # SpecEdge's edge vs server-only comparison, simulated
    python -m sim floor --rounds-per-user-s 0.61   # the event loop's own cost: a floor under any run's wall time

Bad input (a profile of another model or dtype, a workload with an unknown key or an impossible
value, a deployment that does not validate) is one message naming the field, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import yaml
from pydantic import ValidationError

from deploy.config import AppConfig
from sim.cost_profile import CostProfile, HostCost, ProfileError
from sim.system import System
from sim.virtual_time import VirtualClock, run
from sim.workload import Workload


def load_app(path: str | Path, sets: list[str] = ()) -> AppConfig:
    """The deployment: a ``serve run`` YAML (its first application's ``args``) or an args mapping;
    ``sets``: ``dotted.key=JSON`` overrides."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"deployment {path}: cannot read it ({e})") from None
    if isinstance(data, dict) and "applications" in data:
        data = (data["applications"] or [{}])[0].get("args") or {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=JSON")
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        try:
            node[leaf] = json.loads(value)
        except json.JSONDecodeError:
            node[leaf] = value
    try:
        return AppConfig(**data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise ValueError(f"deployment {path}: {'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None


def simulate(app: AppConfig, profile: CostProfile, workload: Workload, seed: int = 0,
             host: HostCost = HostCost()) -> dict:
    """One simulation; its summary with the wall seconds it took. The replicas' and the router's
    logs (a KV plan per replica, a line per failed call of a killed replica) are quiet meanwhile."""
    vc = VirtualClock()
    t0 = time.perf_counter()
    serve_log = logging.getLogger("ray.serve")
    level = serve_log.level
    serve_log.setLevel(logging.ERROR)
    try:
        system = System(app, profile, workload, seed, vc, host)  # checks before anything runs
        out = run(system.run(), vc)
    finally:
        serve_log.setLevel(level)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _seeds(text: str) -> list[int]:
    lo, sep, hi = text.partition("-")
    try:
        return list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    except ValueError:
        raise ValueError(f"--seed {text!r}: a seed or a range such as 0-19") from None


def _run(args) -> int:
    app = load_app(args.config, args.set)
    profile, workload, host = CostProfile.load(args.profile), Workload.load(args.workload), HostCost.load(args.host)
    seeds, failed = _seeds(args.seed), []
    for seed in seeds:
        out = simulate(app, profile, workload, seed, host)
        bad = [k for k, ok in out["invariants"].items() if not ok]
        failed += [(seed, bad)] if bad else []
        if len(seeds) == 1:
            text = json.dumps(out, indent=2)
            print(text)
            if args.out:
                Path(args.out).write_text(text)
        else:
            print(f"seed {seed}: {out['verified_tokens_per_s']:.0f} tok/s, outcomes {out['outcomes']}, "
                  f"reopens {out['reopens']}, killed {out['replicas_killed']}: "
                  f"{'invariants hold' if not bad else 'FAILED ' + ', '.join(bad)}", flush=True)
    if args.check and failed:
        print(f"python -m sim: invariants failed for {failed}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one simulation: its summary as JSON")
    for p in (r,):
        p.add_argument("--config", default="deploy/config.yaml", help="the deployment (serve run YAML or args)")
        p.add_argument("--profile", required=True, help="a benchmarks.verify_step JSON of the target")
        p.add_argument("--workload", required=True, help="a workload YAML (sim/workload.py)")
        p.add_argument("--host", default=None, help="the host's CPU per request outside the forward (a JSON: "
                                                    "router_ms_per_request, replica_ms_per_request, optionally "
                                                    "client_ms_per_request, cores, background_cores, reply_share, "
                                                    "admit_share, burst_cores, burst_s, burst_every_s, client_weight, "
                                                    "client_reply_share; "
                                                    "e.g. sim/validation/host-loadtest-300.json); none by default")
        p.add_argument("--seed", default="0", help="a seed, or a range (0-19): one summary line each")
        p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a deployment field")
        p.add_argument("--out", help="also write the summary here (one seed)")
        p.add_argument("--check", action="store_true", help="exit 1 if an invariant fails (summary.invariants)")
    from sim import floor, paper, plan, validate

    for module in (validate, plan, paper, floor):
        module.add_parser(sub)
    args = ap.parse_args(argv)
    try:
        return {"run": _run, "validate": validate.main, "plan": plan.main, "paper": paper.main,
                "floor": floor.main}[args.cmd](args)
    except (ProfileError, ValueError) as e:
        print(f"python -m sim: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
