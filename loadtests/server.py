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

``--cluster '{"workers": 2, "redis": true}'`` runs the app on a head and worker nodes of this machine
(loadtests/cluster.py) instead of one local node, and ``--control FILE`` takes fault commands as the file grows
(``kill_node``, ``kill_gcs DOWN_S``: :class:`Chaos`; the chaos scenario, loadtests/README.md).

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
import random
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
    ap.add_argument("--cluster", default="", help='a multi-node cluster on this machine (loadtests/cluster.py): '
                    '{"workers": 2, "redis": true, "node_back_after_s": 30}; "" = one local node')
    ap.add_argument("--control", default="", help="a file of fault commands, one a line, read as it grows: "
                                                  "kill_node | kill_gcs DOWN_S (with --cluster)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from deploy.request_path import RequestPathConfig

    os.environ.update(RequestPathConfig(**json.loads(args.request_path)).env())  # before Ray starts
    os.environ["RAY_worker_niceness"] = str(args.worker_niceness)

    import ray
    from ray import serve

    from benchmarks.bursts import BurstSampler
    from benchmarks.proc_stats import CLK, CpuSnapshot, host_cpu_s, rss_bytes
    from deploy.application import build_app, verifier_deployment
    from deploy.config import AppConfig

    app_args = json.loads(Path(args.config).read_text())
    stop = {"flag": False}
    kill = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGUSR1, lambda *_: kill.update(flag=True))

    spec = json.loads(args.cluster) if args.cluster else None
    cluster = faults = None
    if spec:  # head (this process its driver) + worker nodes, Serve's proxy on each (the clients use the head's)
        from loadtests import faults
        from loadtests.cluster import LocalCluster

        cluster = LocalCluster(workers=int(spec["workers"]), redis=bool(spec.get("redis")), http_port=args.port,
                               system_config={"worker_niceness": args.worker_niceness}).start()
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        cluster.start_serve(logging_config={"enable_access_log": app_args.get("access_log", True)})
    else:
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
    background = BurstSampler().start()  # every 0.1 s: the CPU of the processes beside the router and verifiers

    def flush() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"samples": samples, "events": events, "procs": procs, "router_probe": probe,
                                   "background_cpu": background.samples}))
        tmp.replace(out)

    def sample_procs() -> None:
        snap = CpuSnapshot.take(os.getpid(), roles)
        roles.update(snap.roles)
        background.watch(pid for pid, role in snap.roles.items() if role not in ("router", "verifier"))
        cpu: dict[str, float] = {}
        for pid, ticks in snap.ticks.items():
            cpu[snap.roles[pid]] = cpu.get(snap.roles[pid], 0.0) + ticks / CLK
        procs.append({"t": time.time(), "cpu_s_by_role": cpu, "cpu_s_total": snap.total_ticks / CLK,
                      "host_cpu_s": host_cpu_s(),
                      "rss": {str(pid): [role, rss_bytes(pid)] for pid, role in snap.roles.items()
                              if role in ("router", "verifier", "proxy")}})

    chaos = Chaos(cluster, faults, events, holder, int(app_args.get("verifier", {}).get("num_replicas", 1)),
                  float((spec or {}).get("node_back_after_s", 30.0)), args.control) if cluster else None

    async def sample() -> None:
        # an async loop: with RAY_SERVE_THROUGHPUT_OPTIMIZED a handle only works inside one
        n = 0
        while not stop["flag"]:
            if chaos is not None:
                chaos.step()  # here, in the main thread: nodes and the GCS outlive the thread that starts them
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
        background.stop()
        flush()
        if cluster is not None:
            cluster.shutdown()
        else:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
    return 0


class Chaos:
    """Fault commands from ``--control`` (written by loadtests/run.py on the scenario's schedule), acted on in the
    sampling loop: ``kill_node`` SIGKILLs a worker node holding a verifier replica and adds a new node
    ``node_back_after_s`` later; ``kill_gcs S`` SIGKILLs the head's gcs_server and starts it again S seconds later.
    Every step is an event in the server's stats (the report's fault figures)."""

    def __init__(self, cluster, faults, events: list, deployment: str, replicas: int, node_back_after_s: float,
                 control: str):
        self.cluster, self.faults, self.events = cluster, faults, events
        self.deployment, self.replicas, self.back_after = deployment, replicas, node_back_after_s
        self.control, self.offset = Path(control) if control else None, 0
        self.pending: list[tuple[float, str]] = []  # (when, action)
        self.gcs_down = False
        self.watch: dict | None = None  # a node back: waiting for Serve to restore the replica count

    def _event(self, name: str, **kw) -> None:
        self.events.append({"t": time.time(), "event": name, **kw})
        print(f"[loadtests.server] {name} {kw}", flush=True)

    def _commands(self) -> list[str]:
        if self.control is None or not self.control.exists():
            return []
        data = self.control.read_text()
        new, self.offset = data[self.offset:], len(data)
        return [line.split() for line in new.splitlines() if line.strip()]

    def step(self) -> None:
        now = time.time()
        for cmd in self._commands():
            try:
                if cmd[0] == "kill_node":
                    self.kill_node()
                elif cmd[0] == "kill_gcs":
                    ev = self.cluster.kill_gcs()
                    self.gcs_down = True
                    self._event("gcs_killed", **ev)
                    self.pending.append((now + float(cmd[1]), "start_gcs"))
            except Exception as e:  # noqa: BLE001 (recorded: the report's checks see it)
                self._event("fault_error", command=" ".join(cmd), error=f"{type(e).__name__}: {e}"[:300])
        for when, action in [p for p in self.pending if p[0] <= now]:
            self.pending.remove((when, action))
            try:
                if action == "start_gcs":
                    self._event("gcs_started", **self.cluster.start_gcs())
                    self.gcs_down = False
                elif action == "node_back":
                    node = self.cluster.add_worker()
                    self._event("node_back", node_id=node.node_id)
                    self.watch = {"since": time.time()}
            except Exception as e:  # noqa: BLE001
                self._event("fault_error", command=action, error=f"{type(e).__name__}: {e}"[:300])
        if self.watch is not None and not self.gcs_down:
            try:
                reps = self.faults.replicas(self.deployment)
                ok = (self.faults.running_replicas(self.deployment) == self.replicas
                      and len(set(reps.values())) == len(reps) == self.replicas)
            except Exception:  # noqa: BLE001 (Serve or the GCS busy: ask again next time)
                ok = False
            if ok:
                self._event("replicas_restored", after_node_back_s=round(time.time() - self.watch["since"], 2))
                self.watch = None

    def kill_node(self) -> None:
        reps = self.faults.replicas(self.deployment)
        routers = self.faults.replicas("Router")
        cands = [n for n in self.cluster.alive_workers() if n.node_id in reps.values()]
        if not cands:
            self._event("fault_error", command="kill_node", error=f"no worker node holds a replica: {reps}")
            return
        victim = random.choice(cands)
        killed = self.cluster.kill_node(victim)
        self._event("node_killed", **killed, replicas=sum(v == victim.node_id for v in reps.values()),
                    routers=sum(v == victim.node_id for v in routers.values()))
        self.pending.append((time.time() + self.back_after, "node_back"))


if __name__ == "__main__":
    sys.exit(main())
