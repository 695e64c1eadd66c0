"""The cheapest request path for edges: CPU microseconds per verify round in each server hop,
HTTP ``POST /v1/sessions/{id}/verify`` vs the WebSocket ``/v1/sessions/{id}/ws`` (same binary
frames, :mod:`specdec.protocol`).

``python -m benchmarks.request_path [--rounds 300] [--nodes 8] [--repeats 2] [--smoke]``

- The Serve app (:class:`benchmarks.run_harness.Server`: ``serve_proc`` under ``taskset -c 0``, Ray with
  one CPU, the verifier with one torch thread) serves ``--target`` (default ``tiny-random``: the
  forward is cheap, so the request path dominates what is measured).
- This process is the edge, pinned to core 1: :class:`edge_agent.transport.HttpTransport`, the
  agent's own transport, with ``ws=False`` (HTTP, keep-alive) or ``ws=True`` (one WebSocket per
  session). Per transport and repeat: open ``--sessions`` sessions, a few unmeasured warm-up
  rounds (the first over POST while the session's WebSocket opens; the window waits for it),
  then ``--rounds`` verify rounds of a ``--nodes``-node chain (random draft tokens), each
  session one round after another; transports alternate
  (HTTP, WS, WS, HTTP, ...) so drift hits both alike.
- CPU per process from /proc (:class:`benchmarks.proc_stats.CpuSnapshot`) over each window,
  per role: ``proxy`` (Serve's ``ray::ProxyActor``), ``router`` and ``verifier`` (``ray::
  ServeReplica:specedge:Router`` / ``...:Verifier``), and the rest of the server (Serve
  controller, raylet, GCS, Ray agents, the driver). An idle window of ``--idle-s`` before the
  rounds gives each role's background rate (health checks, metrics, controller loops); ``net``
  figures subtract it. The edge's own CPU per round (this process) is reported too.

Output: a table on stdout and JSON in ``benchmarks/results/request_path.json`` (``--out``).
``--smoke`` (40 rounds, 1 repeat, 1 s idle window) is the ``make test`` wiring check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.proc_stats import CpuSnapshot
from benchmarks.run_harness import Server, log
from benchmarks.run_plan import API_KEY, EDGE_CORE, PLANS, REPO, RESULTS, SERVER_CORE, app_config
from deploy.request_path import RequestPathConfig, add_cli_options

HOPS = ("proxy", "router", "verifier")  # the request path, in order
TRANSPORTS = ("http", "ws")


def _server_config(target: str, access_log: bool) -> dict:
    plan = PLANS["smoke"] if target.startswith("tiny") else PLANS["quick"]
    cfg = app_config(plan, "ngram", depth=2)  # no server-side draft model needed here
    cfg["target"] = {"model": target, "dtype": "auto"}
    cfg["access_log"] = access_log
    cfg["topology"] = "split"  # each hop in a process of its own, so that each is measured
    return cfg


def split_roles(by_role: dict[str, float]) -> dict[str, float]:
    """A window's CPU by role -> the three hops, ``ray_rest`` (everything else), ``server``."""
    out = {h: by_role.get(h, 0.0) for h in HOPS}
    out["ray_rest"] = sum(v for k, v in by_role.items() if k not in HOPS)
    out["server"] = sum(by_role.values())
    return out


def per_round(cpu_s: dict[str, float], idle_rate: dict[str, float], wall_s: float, rounds: int) -> dict:
    """CPU microseconds per round, raw and net of the idle background rate (CPU s per wall s)."""
    raw = {k: 1e6 * v / rounds for k, v in cpu_s.items()}
    net = {k: 1e6 * (v - idle_rate.get(k, 0.0) * wall_s) / rounds for k, v in cpu_s.items()}
    return {"raw": raw, "net": net}


async def _rounds(transport: str, url: str, sessions: int, rounds: int, warmup: int, nodes: int, vocab: int,
                  seed: int, server: Server, roles: dict[int, str]) -> dict:
    from specdec.protocol import OpenSession, VerifyFrame
    from edge_agent.transport import HttpTransport

    rng = random.Random(seed)
    parents = [i - 1 for i in range(nodes)]  # a chain: node i hangs under node i-1
    prompt_len = 16
    need = prompt_len + (warmup + rounds) * (nodes + 1) + 8
    if need > 4000:
        raise SystemExit(f"{rounds} rounds of {nodes} nodes may outgrow the context; lower --rounds or --nodes")
    async with HttpTransport(url, api_key=API_KEY, ws=(transport == "ws"), timeout_s=120.0) as tr:
        opened = [await tr.open(OpenSession(prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt_len)],
                                            sampling={"temperature": 0.0, "ignore_eos": True,
                                                      "max_tokens": need - prompt_len}))
                  for _ in range(sessions)]
        prefix = {o.session_id: o.prefix_len for o in opened}
        lat: list[float] = []

        async def run(sid: str, n: int, record: bool) -> int:
            done = 0
            for _ in range(n):
                frame = VerifyFrame(prefix_len=prefix[sid], tokens=[rng.randrange(3, vocab) for _ in range(nodes)],
                                    parents=parents, depth=nodes)
                t = time.perf_counter()
                rep = await tr.verify(sid, frame)
                if record:
                    lat.append(time.perf_counter() - t)
                prefix[sid] = rep.prefix_len
                done += 1
                if rep.finished:
                    break
            return done

        await asyncio.gather(*(run(sid, warmup, False) for sid in prefix))
        # a session's first round goes over POST while its socket opens: measure the socket's rounds only
        if transport == "ws" and not all([await tr.socket_ready(sid) for sid in prefix]):
            raise SystemExit("a session's WebSocket did not open; the WebSocket rounds cannot be measured")
        stats0 = server.stats()
        snap0 = CpuSnapshot.take(server.proc.pid, roles)
        c0, t0 = time.process_time(), time.perf_counter()
        done = sum(await asyncio.gather(*(run(sid, rounds // sessions, True) for sid in prefix)))
        wall, edge_cpu = time.perf_counter() - t0, time.process_time() - c0
        snap1 = CpuSnapshot.take(server.proc.pid, roles)
        stats1 = server.stats()
        for sid in prefix:
            await tr.close(sid)
    win = snap1.since(snap0)
    return {"transport": transport, "rounds": done, "wall_s": wall, "cpu_s": split_roles(win["by_role"]),
            "by_role": win["by_role"], "edge_cpu_s": edge_cpu, "cores": win["cores"],
            "verifier_busy_s": stats1["busy_seconds"] - stats0["busy_seconds"],
            "latency_ms_p50": 1e3 * statistics.median(lat) if lat else float("nan"),
            "latency_ms_mean": 1e3 * statistics.fmean(lat) if lat else float("nan")}


def summarise(windows: list[dict], idle_rate: dict[str, float]) -> dict:
    """Per transport: CPU microseconds per round per hop (summed over repeats), raw and net."""
    out = {}
    for tr in TRANSPORTS:
        ws = [w for w in windows if w["transport"] == tr]
        if not ws:
            continue
        rounds = sum(w["rounds"] for w in ws)
        wall = sum(w["wall_s"] for w in ws)
        cpu = {k: sum(w["cpu_s"][k] for w in ws) for k in ws[0]["cpu_s"]}
        pr = per_round(cpu, idle_rate, wall, rounds)
        out[tr] = {"rounds": rounds, "wall_s": wall, "us_per_round": pr,
                   "edge_us_per_round": 1e6 * sum(w["edge_cpu_s"] for w in ws) / rounds,
                   "verifier_busy_us_per_round": 1e6 * sum(w["verifier_busy_s"] for w in ws) / rounds,
                   "latency_ms_p50": statistics.median(w["latency_ms_p50"] for w in ws),
                   "rounds_per_s": rounds / wall}
    return out


def table(summary: dict) -> str:
    rows = [("proxy", "Serve HTTP proxy"), ("router", "router replica"), ("verifier", "verifier replica"),
            ("ray_rest", "rest of the server (controller, raylet, GCS, agents)"), ("server", "whole server")]
    head = "| hop | HTTP us/round (net) | WS us/round (net) | WS / HTTP | HTTP raw | WS raw |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    h, w = summary.get("http"), summary.get("ws")
    for key, name in rows:
        hn, wn = h["us_per_round"]["net"][key], w["us_per_round"]["net"][key]
        ratio = f"{wn / hn:.2f}" if hn > 0 else "-"
        lines.append(f"| {name} | {hn:.0f} | {wn:.0f} | {ratio} | {h['us_per_round']['raw'][key]:.0f} "
                     f"| {w['us_per_round']['raw'][key]:.0f} |")
    lines.append(f"| edge client (this process) | {h['edge_us_per_round']:.0f} | {w['edge_us_per_round']:.0f} | "
                 f"{w['edge_us_per_round'] / h['edge_us_per_round']:.2f} | | |")
    lines.append(f"| verifier busy (forwards) | {h['verifier_busy_us_per_round']:.0f} | "
                 f"{w['verifier_busy_us_per_round']:.0f} | | | |")
    lines.append(f"| round latency p50 (ms) | {h['latency_ms_p50']:.2f} | {w['latency_ms_p50']:.2f} | "
                 f"{w['latency_ms_p50'] / h['latency_ms_p50']:.2f} | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny-random", help="tiny-random (default) | embedded")
    ap.add_argument("--rounds", type=int, default=300, help="measured verify rounds per transport and repeat")
    ap.add_argument("--nodes", type=int, default=8, help="draft nodes per verify frame (a chain)")
    ap.add_argument("--sessions", type=int, default=1, help="concurrent sessions sharing the rounds")
    ap.add_argument("--repeats", type=int, default=2, help="windows per transport (alternating order)")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured rounds per session first")
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle window for the background CPU rate")
    ap.add_argument("--access-log", choices=("on", "off"), default="on",
                    help="Serve's per-request access log (on = the deployed default)")
    ap.add_argument("--smoke", action="store_true", help="40 rounds, 1 repeat, 1 s idle window (tests)")
    ap.add_argument("--out", default=str(RESULTS / "request_path.json"))
    ap.add_argument("--seed", type=int, default=0)
    add_cli_options(ap)
    args = ap.parse_args(argv)
    path = RequestPathConfig().override(args.ingress, args.throughput_optimized)
    if args.smoke:
        args.rounds, args.repeats, args.idle_s, args.warmup = 40, 1, 1.0, 3
    if args.rounds < args.sessions:
        ap.error("--rounds must be at least --sessions")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {EDGE_CORE})  # the edge off the server's core
    vocab = 512 if args.target.startswith("tiny") else 49152

    workdir = REPO / ".cache" / "bench" / time.strftime("request_path-%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True, exist_ok=True)
    server = Server(_server_config(args.target, args.access_log == "on"), workdir, nice=0, request_path=path)
    try:
        server.wait_ready()
        snap = CpuSnapshot.take(server.proc.pid)
        roles = dict(snap.roles)
        missing = [h for h in HOPS if h not in roles.values()]
        if missing:
            raise RuntimeError(f"no process found for {missing} in the server tree: {sorted(set(roles.values()))}")
        log(f"Serve app up on port {server.port}: " + ", ".join(f"{r}={p}" for p, r in sorted(roles.items())
                                                                  if r in HOPS))
        time.sleep(min(2.0, args.idle_s))  # let start-up work settle
        t0, s0 = time.perf_counter(), CpuSnapshot.take(server.proc.pid, roles)
        time.sleep(args.idle_s)
        idle_wall, idle = time.perf_counter() - t0, CpuSnapshot.take(server.proc.pid, roles).since(s0)
        idle_rate = {k: v / idle_wall for k, v in split_roles(idle["by_role"]).items()}
        log("idle background (CPU ms per s): " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in idle_rate.items()))
        order = [t for i in range(args.repeats) for t in (TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1])]
        windows = []
        for i, tr in enumerate(order):
            w = asyncio.run(_rounds(tr, server.url, args.sessions, args.rounds, args.warmup, args.nodes, vocab,
                                    args.seed + i, server, roles))
            windows.append(w)
            log(f"{tr:4s}: {w['rounds']} rounds in {w['wall_s']:.1f} s, server "
                f"{1e6 * w['cpu_s']['server'] / w['rounds']:.0f} us/round raw, p50 {w['latency_ms_p50']:.2f} ms")
    finally:
        server.proc.stop(timeout=90)
    summary = summarise(windows, idle_rate)
    h, w = summary["http"]["us_per_round"]["net"], summary["ws"]["us_per_round"]["net"]
    cheaper = "ws" if w["server"] < h["server"] else "http"
    conditions = {
        "target": args.target + (" (SmolLM2-135M-Instruct, bf16)" if args.target == "embedded" else " (random Llama, "
                                 "2 layers, hidden 64, vocab 512)"),
        "server": f"Serve app on core {SERVER_CORE} (taskset: proxy, router, verifier, controller, raylet, GCS, "
                  "agents; verifier 1 torch thread; Ray num_cpus=1)",
        "edge": f"this process on core {EDGE_CORE}: edge_agent.transport.HttpTransport (ws=False: HTTP keep-alive; "
                "ws=True: one WebSocket per session)",
        "rounds_per_window": args.rounds, "repeats": args.repeats, "sessions": args.sessions, "warmup": args.warmup,
        "frame": f"{args.nodes}-node chain, random draft tokens ({20 + 6 * args.nodes} B uplink)",
        "access_log": args.access_log == "on", "idle_window_s": idle_wall,
        "request_path": path.model_dump(mode="json", exclude={"direct_port"}),
        "cpu": "utime+stime from /proc per process, by role (proxy = ray::ProxyActor, router/verifier = "
               "ray::ServeReplica:specedge:Router/Verifier); net = raw minus the idle background rate x wall",
        "cores_seen": sorted({c for w in windows for c in w["cores"]}), "loadavg_1m_end": os.getloadavg()[0],
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    doc = {"conditions": conditions, "idle_cpu_ms_per_s": {k: 1e3 * v for k, v in idle_rate.items()},
           "summary": summary, "windows": windows, "cheaper": cheaper,
           "server_us_saved_per_round": h["server"] - w["server"] if cheaper == "ws" else w["server"] - h["server"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print()
    print(f"CPU microseconds per verify round ({args.target}, {args.nodes}-node chain, {args.sessions} session(s), "
          f"{args.rounds} rounds x {args.repeats} per transport, server on core {SERVER_CORE}, "
          f"access log {args.access_log}):")
    print(table(summary))
    print(f"\ncheaper path per round for the whole server: {cheaper} "
          f"({doc['server_us_saved_per_round']:.0f} us less); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
