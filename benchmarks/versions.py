"""One frozen draft, evolving targets (FlexSpec §III): the embedded draft against the base and each
LoRA version of the embedded target, with and without per-version adaptation.

``python -m benchmarks.versions [--sessions S] [--prompts P] [--max-tokens N] [--rtt MS]``
(``make bench-versions``). The Serve app serves the base and the two versions of
``deploy/artifacts/versions`` (``benchmarks/train_versions.py``) on one core, the edge process
runs edge agents (``edge_full``: proactive, server pacing + FlexSpec depth) with the frozen
``embedded-draft`` on the other, through the WAN proxy: the machinery of :mod:`benchmarks.run`
(server, edge process, proxy, whole-server CPU from /proc by :mod:`benchmarks.proc_stats`).

Per setting of ``pacing.per_version`` (on: each version's budget and depth hints come from its
own acceptance; off: one acceptance for all), one server, then phases in the order a platform
meets them: the base alone, ``code`` alone, ``docs`` alone, then all three mixed. Without
per-version adaptation the later phases inherit what the earlier ones taught the pacer.
Figures per (setting, phase, version): tokens per verify round, depth, nodes sent per round,
and whole-server tokens per CPU-second of the phase. Output: ``benchmarks/results/versions-*.json``
and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.run_harness import EdgeWorker, Server, log, run_config
from benchmarks.run_plan import REPO, RESULTS, Plan, app_config, prompt_ids
from benchmarks.run_report import fmt

VERSIONS = {v: str(REPO / "deploy" / "artifacts" / "versions" / v) for v in ("code", "docs")}
PHASES = {"base": [None], "code": ["code"], "docs": ["docs"], "mixed": [None, "code", "docs"]}


def figures(res: dict, window: dict | None = None) -> dict:
    out = {k: res.get(k) for k in ("tokens", "generations", "tokens_per_verify", "depth_mean",
                                   "sent_nodes_per_round", "verified_nodes_per_round")}
    if window is not None:
        out["server_cpu_s"] = window["server_cpu_s"]
        out["tokens_per_server_cpu_s"] = window["tokens_emitted"] / max(window["server_cpu_s"], 1e-9)
        out["verifier_busy_s"] = window["verifier_busy_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=2, help="concurrent sessions per version in a phase")
    ap.add_argument("--prompts", type=int, default=8, help="generations per version in a phase")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rtt", type=float, default=15.0)
    ap.add_argument("--depth", type=int, default=3, help="starting depth (edge_full adapts it)")
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--out-dir", default=str(RESULTS))
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    missing = [p for p in VERSIONS.values() if not Path(p, "adapter_model.safetensors").exists()]
    if missing:
        raise SystemExit(f"target versions missing ({missing}): run `make adapters`")
    plan = Plan("versions", "embedded", "embedded-draft", rtts=[a.rtt], rtt_sessions=a.sessions, sessions=[a.sessions],
                sessions_rtt=a.rtt, prompts=a.prompts, max_tokens=a.max_tokens, depth=a.depth, warmup_tokens=8)
    prompts, names = prompt_ids(plan, a.prompts)
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-versions"
    workdir = REPO / ".cache" / "bench" / run_id
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for adapt in (True, False):
        cfg = app_config(plan, "embedded-draft", a.depth)
        cfg["target"].update(adapters=VERSIONS, max_loaded_adapters=2)
        cfg["pacing"] = {"per_version": adapt}
        server, edge = Server(cfg, workdir, a.nice), EdgeWorker(workdir, a.nice)
        try:
            edge.call({"op": "init", "draft": "embedded-draft", "tokenizer": True, "threads": 1})
            log(f"per_version={adapt}: {server.wait_ready()}")
            run_config(server, edge, plan, "edge_full", 0.0, 1, prompts[:1], a.depth, workdir, 8)  # warm-up
            for phase, versions in PHASES.items():
                S = a.sessions * len(versions)
                res, extra = run_config(server, edge, plan, "edge_full", a.rtt, S, prompts * len(versions), a.depth,
                                        workdir, a.max_tokens, extra={"versions": versions})
                whole = figures(res, extra["window"])
                split = res.get("by_version") or {str(versions[0]): res}
                for v in versions:
                    r = {"per_version": adapt, "phase": phase, "version": v or "base", **figures(split[str(v)]),
                         "phase_tokens_per_server_cpu_s": whole["tokens_per_server_cpu_s"],
                         "phase_server_cpu_s": whole["server_cpu_s"],
                         "loadavg_1m": extra["noise"]["loadavg_1m"][1]}
                    rows.append(r)
                    log(f"per_version={adapt} {phase:5s} {r['version']:4s}: {fmt(r['tokens_per_verify'], 2)} tok/round, "
                        f"depth {fmt(r['depth_mean'], 2)}, {fmt(r['sent_nodes_per_round'])} nodes/round; phase "
                        f"{fmt(r['phase_tokens_per_server_cpu_s'])} tok/server-CPU-s")
        finally:
            edge.stop()
            server.proc.stop(timeout=90)
    doc = {"run_id": run_id, "conditions": {
        "target": "SmolLM2-135M-Instruct (embedded), bf16, + LoRA versions code/docs (r=8, last 10 layers)",
        "draft": "embedded-draft (frozen)", "mode": "edge_full", "rtt_ms": a.rtt, "sessions_per_version": a.sessions,
        "generations_per_version": a.prompts, "max_tokens": a.max_tokens, "prompts": names,
        "cores": "server core 0, edge core 1 (benchmarks.run machinery)", "cpus": os.cpu_count()}, "rows": rows}
    out = Path(a.out_dir) / f"{run_id}.json"
    out.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    print(markdown(rows))
    print(f"written {out}")
    return 0


def markdown(rows: list[dict]) -> str:
    lines = ["| per-version pacing | phase | version | tokens / verify round | depth | nodes sent / round | "
             "phase tokens / whole-server CPU-s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'on' if r['per_version'] else 'off'} | {r['phase']} | {r['version']} | "
                     f"{fmt(r['tokens_per_verify'], 2)} | {fmt(r['depth_mean'], 2)} | {fmt(r['sent_nodes_per_round'])} | "
                     f"{fmt(r['phase_tokens_per_server_cpu_s'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
