"""One command: start (or target) the app, run Locust headless, write the report.

    python -m loadtests.run --users 1000 --spawn-rate 100 --duration 60s [--scenario ramp]
    python -m loadtests.run --scenario tenants --users 200 --duration 40s
    python -m loadtests.run --host http://127.0.0.1:8123 --scenario smoke ...   # an app already serving
    python -m loadtests.run --users 100,200,400 --duration 60s              # a sweep: largest count held

Processes: this one computes the workload (target continuations) with a local copy of the
target, starts ``python -m loadtests.server`` (local Ray + Serve on a free loopback port)
unless ``--host`` is given, then runs ``locust`` as its own process(es), never inside the
Ray process (gevent + Ray hang), and stops the server by PID at the end. Output in
``--out`` (default ``.cache/loadtests/<scenario>-<time>``): Locust's CSVs, the users'
counters, the verifier's samples, ``summary.json``, ``report.md`` and PNG plots.
With ``--host``, the app must have been built from the same scenario (``--print-app-config``
prints its ``build_app`` args), since the users take tenants and keys from it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.child_group import start_healthy, stop_group
from deploy.request_path import add_cli_options
from loadtests import report
from loadtests.config import SCENARIOS, TARGETS, LoadTestConfig, scenario
from loadtests.workload import build_workload, write_user_config

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_duration(text: str) -> float:
    """Locust-style durations: ``90``, ``60s``, ``2m``, ``1m30s``."""
    text = text.strip()
    if text.replace(".", "", 1).isdigit():
        return float(text)
    total, num = 0.0, ""
    for ch in text:
        if ch.isdigit() or ch == ".":
            num += ch
        elif ch in "hms" and num:
            total += float(num) * {"h": 3600, "m": 60, "s": 1}[ch]
            num = ""
        else:
            raise argparse.ArgumentTypeError(f"bad duration {text!r} (use e.g. 60s, 2m, 1m30s)")
    if num:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: a number without unit at the end")
    return total


def _child_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def start_server(cfg: LoadTestConfig, out: Path, timeout: float = 240.0,
                 worker_niceness: int = 0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    rp = cfg.request_path.model_copy(update={"direct_port": free_port()})
    app_file = out / "app_config.json"
    app_file.write_text(json.dumps(cfg.app))
    url = f"http://127.0.0.1:{rp.client_port(port)}"
    cmd = [sys.executable, "-m", "loadtests.server", "--config", str(app_file), "--port", str(port), "--stats-out",
           str(out / "server_stats.json"), "--request-path", rp.model_dump_json(), "--worker-niceness",
           str(worker_niceness)]
    if cfg.cluster_workers:  # issue 65: a head + worker nodes, faults on the schedule run_locust writes
        cmd += ["--cluster", json.dumps({"workers": cfg.cluster_workers, "redis": cfg.gcs_ft,
                                         "node_back_after_s": cfg.node_back_after_s}),
                "--control", str(control_file(out))]
    return start_healthy(cmd, url, (out / "server.log", out / "server.second-try.log"), timeout, _child_env(),
                         cwd=REPO)[0], url


def control_file(out: Path) -> Path:
    """Where run_locust writes fault commands for the server (loadtests/server.py ``Chaos``)."""
    return out / "control"


def fault_schedule(cfg: LoadTestConfig, duration: float) -> list[tuple[float, str]]:
    """(seconds after Locust's start, command) for the scenario's node kills and GCS restart within ``duration``."""
    out = []
    t = cfg.kill_node_at_s
    while t is not None and t < duration:
        out.append((t, "kill_node"))
        t = t + cfg.kill_node_every_s if cfg.kill_node_every_s else None
    if cfg.gcs_restart_at_s is not None and cfg.gcs_restart_at_s < duration:
        out.append((cfg.gcs_restart_at_s, f"kill_gcs {cfg.gcs_down_s:g}"))
    return sorted(out)


def model_info(url: str, key: str) -> dict:
    r = httpx.get(f"{url}/v1/model", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    r.raise_for_status()
    return r.json()


def run_locust(cfg: LoadTestConfig, url: str, users: int, spawn_rate: float, duration: float, out: Path,
               users_file: Path, server: subprocess.Popen | None, stop_timeout: float,
               client_niceness: int = 0, processes: int = 1, probe_rate: float = 0.0,
               control: Path | None = None) -> dict:
    """One headless Locust run; returns timing facts for the report. ``client_niceness``: Locust's
    nice (below 0 needs root): on a machine the simulated clients share with the server, -5 gives
    them the CPU first, as clients on their own machines would have it. Linux shares the CPU between
    sessions (autogroups) before their processes, and a process's nice weighs only inside its
    session: Locust then runs in a session of its own, that nice given to it (``client_autogroup``).
    ``processes`` > 1: Locust forks that many worker processes under a master (``--processes``), the
    users spread over them, each writing its own counters (merged by the report)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["nice", "-n", str(client_niceness)] if client_niceness else []
    cmd += [sys.executable, "-m", "locust", "-f", str(REPO / "loadtests" / "locustfile.py"), "--headless",
           "-u", str(users), "-r", str(spawn_rate), "-t", f"{int(round(duration))}s", "--host", url,
           "--csv", str(out / "locust"), "--csv-full-history", "--only-summary", "--loglevel", "WARNING",
           "--stop-timeout", str(int(stop_timeout)), "--exit-code-on-error", "0",
           "--loadtest-config", str(users_file),
           "--loadtest-out", str(out / "counters.json")]
    if processes > 1:
        cmd += ["--processes", str(processes)]
    env = _child_env()
    t0 = time.time()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out / "locust.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=bool(client_niceness))
        autogroup = bool(client_niceness) and autogroup_nice(proc.pid, client_niceness)
        probe = start_probe(url, users_file, probe_rate, duration, out) if probe_rate > 0 else None
        try:
            kills, faults_sent = _follow(proc, cfg, server, control, t0, duration, duration + stop_timeout + 120)
        except BaseException:  # interrupted: a Locust in a session of its own gets no terminal signal
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=30)
            raise
    if probe is not None:
        try:
            probe.wait(timeout=60)
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.wait()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # Locust, reaped: was the client the bottleneck?
    locust_cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return {"locust_started": t0, "locust_ended": time.time(), "locust_rc": proc.returncode,
            "locust_cpu_s": locust_cpu, "client_autogroup": autogroup,
            "kill_sent_at": kills[0] if kills else None, "kills_sent_at": kills, "faults_sent": faults_sent}


def _follow(proc: subprocess.Popen, cfg: LoadTestConfig, server: subprocess.Popen | None, control: Path | None,
            t0: float, duration: float, limit: float) -> tuple[list[float], list[tuple[float, str]]]:
    """Until Locust exits: the scenario's verifier kills and node faults on time, Locust stopped past ``limit``
    seconds; the kills' and faults' times."""
    kills: list[float] = []
    faults = fault_schedule(cfg, duration) if control is not None else []
    faults_sent: list[tuple[float, str]] = []
    next_kill = cfg.kill_verifier_at_s
    while proc.poll() is None:
        el = time.time() - t0
        if next_kill is not None and server is not None and el >= next_kill and el < duration:
            server.send_signal(signal.SIGUSR1)
            kills.append(time.time())
            next_kill = next_kill + cfg.kill_verifier_every_s if cfg.kill_verifier_every_s else None
        while faults and el >= faults[0][0]:
            _, command = faults.pop(0)
            with open(control, "a") as f:
                f.write(command + "\n")
            faults_sent.append((time.time(), command))
        if el > limit:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
            break
        time.sleep(0.2)
    return kills, faults_sent


def autogroup_nice(pid: int, nice: int) -> bool:
    """Give ``pid``'s autogroup (its session) ``nice``, True only where it now holds it: False where there
    are no autogroups, where the process's CPU group is a cgroup rather than its autogroup (the file reads
    empty, as in most containers: the nice would weigh nothing), or where this user may not."""
    path = Path(f"/proc/{pid}/autogroup")
    try:
        if not path.read_text().strip():
            return False
        path.write_text(str(nice))
        return path.read_text().split()[1:] == ["nice", str(nice)]
    except OSError:
        return False


def probe_priority() -> tuple[list[str], str]:
    """The command prefix that runs the latency probe ahead of the load on shared cores, and its
    name: real-time FIFO where this user may set it (root), else nice -10, else as it is."""
    if os.geteuid() == 0 and shutil.which("chrt"):
        return ["chrt", "-f", "10"], "SCHED_FIFO 10"
    if os.geteuid() == 0:
        return ["nice", "-n", "-10"], "nice -10"
    return [], "nice 0"


def start_probe(url: str, users_file: Path, rate: float, duration: float, out: Path) -> subprocess.Popen:
    """The latency probe (loadtests/probe.py) beside Locust, for the same duration."""
    prefix, name = probe_priority()
    cmd = prefix + [sys.executable, "-m", "loadtests.probe", "--host", url, "--users-config", str(users_file),
                    "--rate", str(rate), "--duration", str(duration), "--out", str(out / "probe.json"),
                    "--priority", name]
    with open(out / "probe.log", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=_child_env(), stdout=log, stderr=subprocess.STDOUT)


def parse_users(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=parse_users, default=[100], help="simulated users; a comma list sweeps")
    ap.add_argument("--spawn-rate", type=float, default=100.0, help="users started per second")
    ap.add_argument("--duration", type=parse_duration, default=60.0, help="run time per user count (60s, 2m)")
    ap.add_argument("--scenario", choices=SCENARIOS, default="ramp")
    ap.add_argument("--target", choices=sorted(TARGETS), default="tiny")
    ap.add_argument("--config", help="a LoadTestConfig YAML instead of a built-in scenario")
    ap.add_argument("--host", help="target an app already serving (built from the same config)")
    ap.add_argument("--out", help="output folder (default .cache/loadtests/<scenario>-<time>)")
    ap.add_argument("--stop-timeout", type=float, default=None,
                    help="seconds users get to close their sessions (default: the request timeout + 10 s)")
    ap.add_argument("--kill-at", type=float, help="kill scenario: seconds into the run (default: the scenario's)")
    ap.add_argument("--kill-node-at", type=parse_duration, help="chaos: first worker node killed (default: 4m)")
    ap.add_argument("--kill-node-every", type=parse_duration, help="chaos: and every (default: 4m)")
    ap.add_argument("--gcs-restart-at", type=parse_duration, help="chaos: the head's GCS killed (default: 10m)")
    add_cli_options(ap)
    ap.add_argument("--worker-niceness", type=int, default=0,
                    help="nice of the app's Ray workers (router, verifier); Ray's own default is 15, which "
                         "puts them below Locust on a shared machine")
    ap.add_argument("--client-niceness", type=int, default=0,
                    help="nice of the Locust process, run in a session of its own so that the nice weighs "
                         "against the server's session (e.g. -5, as root: the clients get the shared cores first, "
                         "as on their own machines; the report states it)")
    ap.add_argument("--locust-processes", type=int, default=1,
                    help="Locust worker processes (one gevent loop each; users spread over them)")
    ap.add_argument("--probe-rate", type=float, default=0.0,
                    help="requests per second of a latency probe beside Locust (loadtests/probe.py: one light "
                         "client at real-time priority where allowed, half verify rounds, half session opens; "
                         "0 = none)")
    ap.add_argument("--print-app-config", action="store_true", help="print the app's build_app args and exit")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the report's checks pass")
    args = ap.parse_args(argv)

    cfg = LoadTestConfig.from_yaml(args.config) if args.config else scenario(args.scenario, args.target)
    if args.stop_timeout is None:  # a user waiting on a request when the run ends still closes its session
        args.stop_timeout = cfg.user.network_timeout_s + 10.0
    if args.kill_at is not None:
        cfg = cfg.model_copy(update={"kill_verifier_at_s": args.kill_at})
    fault_times = {k: v for k, v in (("kill_node_at_s", args.kill_node_at), ("kill_node_every_s", args.kill_node_every),
                                     ("gcs_restart_at_s", args.gcs_restart_at)) if v is not None}
    if fault_times:  # a shortened chaos run: the same faults, sooner
        cfg = cfg.model_copy(update=fault_times)
    cfg = cfg.model_copy(update={"request_path": cfg.request_path.override(args.ingress, args.throughput_optimized)})
    if args.print_app_config:
        print(json.dumps(cfg.app, indent=2))
        return 0
    out = Path(args.out) if args.out else REPO / ".cache" / "loadtests" / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadtest_config.json").write_text(cfg.model_dump_json(indent=2))
    print(f"[loadtests] {cfg.name} on the {cfg.target} target: computing the workload ...", flush=True)
    workload = build_workload(cfg)
    write_user_config(cfg, workload, out / "users.json")

    server = None
    try:
        if args.host:
            url = args.host.rstrip("/")
        else:
            t0 = time.time()
            server, url = start_server(cfg, out, worker_niceness=args.worker_niceness)
            print(f"[loadtests] app up at {url} in {time.time() - t0:.1f} s (pid {server.pid})", flush=True)
        info = model_info(url, next(iter(cfg.tenant_keys().values())))
        if info.get("vocab_size") != workload["vocab_size"] or info.get("model") != workload["model"]:
            print(f"[loadtests] WARNING: the server's target {info} differs from the workload's "
                  f"{workload['model']}; acceptance will not follow the model", flush=True)
        results = []
        for users in args.users:
            sub = out if len(args.users) == 1 else out / f"users-{users}"
            args.spawn_rate = float(users) if cfg.spawn_at_once else args.spawn_rate
            print(f"[loadtests] {users} users, spawn rate {args.spawn_rate:g}/s, {args.duration:g} s ...",
                  flush=True)
            timing = run_locust(cfg, url, users, args.spawn_rate, args.duration, sub, out / "users.json", server,
                                args.stop_timeout, args.client_niceness, args.locust_processes, args.probe_rate,
                                control_file(out) if server is not None and cfg.cluster_workers else None)
            if server is not None and server.poll() is not None:
                print("[loadtests] WARNING: the app process died during the run", flush=True)
            meta = {"users": users, "spawn_rate": args.spawn_rate, "duration_s": args.duration,
                    "processes": args.locust_processes, "host": url, "started_app": server is not None,
                    "worker_niceness": args.worker_niceness if server is not None else None,
                    "client_niceness": args.client_niceness, "probe_rate": args.probe_rate,
                    "server_model": info, **timing}
            summary = report.write_report(sub, cfg, meta, out / "server_stats.json" if server else None)
            results.append(summary)
            print(report.console_line(summary), flush=True)
        if len(results) > 1:
            report.write_sweep(out, cfg, results)
    finally:
        if server is not None:
            stop_group(server)
    print(f"[loadtests] report: {out / ('report.md' if len(args.users) == 1 else 'sweep.md')}", flush=True)
    if args.check:
        failed = [c for s in results for c in s["checks"] if not c["ok"]]
        for c in failed:
            print(f"[loadtests] CHECK FAILED: {c['name']}: {c['detail']}", flush=True)
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
