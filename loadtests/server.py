"""The app under test in its own process: a local Ray, Serve on a loopback port, ``build_app``.

``python -m loadtests.run`` starts this (never Locust and Ray in one process: gevent's
monkey patching hangs Ray) and stops it by PID with SIGTERM. While it serves it samples
the verifier's own statistics four times a second (queue length, batch sizes, busy time) into
``--stats-out``, so the report can tell whether the verifier was saturated. SIGUSR1 kills
one verifier replica (the fault scenario); Serve starts a replacement, and the sessions
it held re-open from their edges' history. Once a second it also drains the router's load
probe (deploy/router/probe.py: event-loop lag and the server-side time of each 429).

    python -m loadtests.server --config app.json --port 8123 --stats-out server.json \
        [--request-path '{"ingress": "direct", "throughput_optimized": true, "direct_port": 30000}'] \
        [--worker-niceness 0]

``--request-path`` (a :class:`deploy.request_path.RequestPathConfig`) sets Serve's request-path
options in this process's environment before Ray starts, so every Ray process inherits them.
``--worker-niceness``: Ray starts its workers (the replicas) at nice 15 unless told otherwise; on
a machine shared with Locust (nice 0) that gives the simulated clients the CPU before the router,
so the load test runs them at 0 by default, as ``benchmarks/run.py`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

APP_NAME = "specedge"


def _kill_one_verifier(ray, deployment: str) -> str | None:
    """Kill a replica of ``deployment``, the one holding the verifier (deploy.application.verifier_deployment)."""
    for a in ray.util.list_named_actors(all_namespaces=True):
        if f"#{deployment}#" in a["name"] and "SERVE_REPLICA" in a["name"]:
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=False)
            return a["name"]
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="JSON file with the AppConfig args")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--stats-out", required=True)
    ap.add_argument("--num-cpus", type=int, default=4, help="Ray's logical CPUs (replicas reserve num_cpus each)")
    ap.add_argument("--request-path", default="{}", help="RequestPathConfig as JSON (deploy/request_path.py)")
    ap.add_argument("--worker-niceness", type=int, default=0, help="nice of Ray's workers (Ray's default: 15)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from deploy.request_path import RequestPathConfig

    os.environ.update(RequestPathConfig(**json.loads(args.request_path)).env())  # before Ray starts
    os.environ["RAY_worker_niceness"] = str(args.worker_niceness)

    import ray
    from ray import serve

    from benchmarks.proc_stats import CLK, CpuSnapshot, rss_bytes
    from deploy.application import build_app, verifier_deployment
    from deploy.config import AppConfig

    app_args = json.loads(Path(args.config).read_text())
    stop = {"flag": False}
    kill = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGUSR1, lambda *_: kill.update(flag=True))

    ray.init(address="local", include_dashboard=False, num_cpus=args.num_cpus, log_to_driver=False,
             configure_logging=False, _node_ip_address="127.0.0.1")
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port},
                logging_config={"enable_access_log": app_args.get("access_log", True)})  # the proxy's
    serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
    holder = verifier_deployment(AppConfig(**app_args))
    handle = serve.get_deployment_handle(holder, APP_NAME)
    router = serve.get_deployment_handle("Router", APP_NAME)
    print(f"[loadtests.server] serving on http://127.0.0.1:{args.port} (pid {os.getpid()})", flush=True)

    samples: list[dict] = []
    events: list[dict] = []
    procs: list[dict] = []  # every 5 s: CPU seconds so far per role, RSS per replica process
    probe: dict[str, list] = {}  # the router's (epoch s, ms) samples by kind (LoadProbe.drain)
    out = Path(args.stats_out)
    roles: dict[int, str] = {}

    def flush() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"samples": samples, "events": events, "procs": procs, "router_probe": probe}))
        tmp.replace(out)

    def sample_procs() -> None:
        snap = CpuSnapshot.take(os.getpid(), roles)
        roles.update(snap.roles)
        cpu: dict[str, float] = {}
        for pid, ticks in snap.ticks.items():
            cpu[snap.roles[pid]] = cpu.get(snap.roles[pid], 0.0) + ticks / CLK
        procs.append({"t": time.time(), "cpu_s_by_role": cpu, "cpu_s_total": snap.total_ticks / CLK,
                      "rss": {str(pid): [role, rss_bytes(pid)] for pid, role in snap.roles.items()
                              if role in ("router", "verifier", "proxy")}})

    async def sample() -> None:
        # an async loop: with RAY_SERVE_THROUGHPUT_OPTIMIZED a handle only works inside one
        n = 0
        while not stop["flag"]:
            if kill["flag"]:
                kill["flag"] = False
                name = _kill_one_verifier(ray, holder)
                events.append({"t": time.time(), "event": "kill_verifier", "actor": name})
                print(f"[loadtests.server] killed verifier replica {name}", flush=True)
            try:
                st = await asyncio.wait_for(handle.get_stats.remote(), 5)
                bs = st.pop("batch_sizes", [])[-256:]
                st["t"] = time.time()
                st["mean_batch"] = sum(bs) / len(bs) if bs else 0.0
                samples.append(st)
            except Exception as e:  # a replica down mid-kill: keep sampling
                events.append({"t": time.time(), "event": "stats_error", "error": f"{type(e).__name__}: {e}"[:300]})
            if n % 4 == 0:
                try:
                    for k, v in (await asyncio.wait_for(router.probe_samples.remote(), 5)).items():
                        probe.setdefault(k, []).extend(v)
                except Exception as e:  # noqa: BLE001 (an overloaded router answers late: keep sampling)
                    events.append({"t": time.time(), "event": "probe_error", "error": f"{type(e).__name__}: {e}"[:300]})
            if n % 20 == 0:
                sample_procs()
            if n % 8 == 0:
                flush()
            n += 1
            await asyncio.sleep(0.25)

    try:
        asyncio.run(sample())
    finally:
        flush()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
