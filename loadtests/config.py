"""Load-test configuration: the app under test, the simulated users, the scenarios.

One :class:`LoadTestConfig` holds both sides, so the simulated users take their tenants
and API keys from the very ``app.router.tenants`` the server is built with
(:func:`deploy.application.build_app` gets ``app`` verbatim). A YAML file of this shape can be
passed with ``--config``; the named scenarios below are built in.

Targets: ``tiny`` is a 2-layer random-weight Llama (vocabulary 512, fp32) so that thousands
of users are meaningful on 2 CPU cores: the verifier still runs real batched tree forwards
with real KV caches, only each forward is cheap. ``embedded`` is the real
SmolLM2-135M-Instruct (bf16). The report names the target it ran against.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from deploy.config import AppConfig
from deploy.request_path import RequestPathConfig

TARGETS: dict[str, dict] = {
    "tiny": {"model": "tiny-random", "dtype": "float32", "seed": 0},
    # ~30x the compute of "tiny" per token (hidden 256, 4 layers; 4.2M parameters): a verifier that
    # is the bottleneck rather than the HTTP proxy, so that fair scheduling decides who is served
    "tiny-wide": {"model": "tiny-random", "dtype": "float32", "seed": 0,
                  "tiny_config": {"hidden_size": 256, "num_layers": 4, "intermediate_size": 1024}},
    "embedded": {"model": "embedded", "dtype": "bfloat16"},
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Draft time per forward of edge device classes (ms). rtx4090: SpecEdge §5.4 measured ~11 ms per
# forward of Qwen3-1.7B on an RTX 4090; jetson-orin: a Jetson Orin-class board with a ~0.5B draft,
# ~3x slower (an assumption, stated as such in the report: no paper here measures one).
DEVICE_DRAFT_MS: dict[str, float] = {"rtx4090": 11.0, "jetson-orin": 35.0}


class UserModel(_Strict):
    """How one simulated edge agent behaves (SpecEdge §4.3: its cycle is draft time + RTT)."""

    draft_ms: float = Field(20.0, ge=0, description="simulated time per draft forward (when devices is empty)")
    devices: dict[str, float] = Field(default_factory=dict,
                                      description="device profile (DEVICE_DRAFT_MS) -> share of the users; "
                                                  "each user drafts at its device's ms per forward")
    rtt_ms: float = Field(40.0, ge=0, description="simulated network round trip (the median over users)")
    rtt_sigma: float = Field(0.0, ge=0, le=2, description="log-normal spread of the users' RTTs around rtt_ms "
                                                          "(0: every user has rtt_ms)")
    jitter: float = Field(0.2, ge=0, le=1, description="uniform +- fraction on draft_ms and rtt_ms per round")
    ws_share: float = Field(0.0, ge=0, le=1, description="share of the users that verify over one WebSocket per "
                                                         "session (the edge agent's default); the rest POST")
    alpha: float = Field(0.7, ge=0, le=1, description="P(draft top-1 = target token) per tree level")
    sibling_alpha: float = Field(0.3, ge=0, le=1, description="P(top-2 sibling = target token | top-1 wrong)")
    depth: int | None = Field(None, ge=1, description="draft forwards per tree; None: the server's depth hint")
    nodes: int | None = Field(None, ge=1, description="tree nodes; None: the server's tree-budget hint")
    max_tokens: int = Field(64, ge=1, description="tokens per generation")
    idle_s: tuple[float, float] = Field((2.0, 8.0), description="pause between generations (uniform range)")
    max_retries: int = Field(30, ge=1, description="429/503 retries per request before it counts as an error")
    network_timeout_s: float = Field(30.0, gt=0, description="a request slower than this is an error")

    @model_validator(mode="after")
    def _check_devices(self):
        unknown = sorted(set(self.devices) - set(DEVICE_DRAFT_MS))
        if unknown:
            raise ValueError(f"unknown device profiles {unknown}; known: {sorted(DEVICE_DRAFT_MS)}")
        if self.devices and not sum(self.devices.values()) > 0:
            raise ValueError("device shares must sum to more than 0")
        return self


class TenantLoad(_Strict):
    """Which share of the simulated users belongs to a tenant (the scheduling weight is the app's)."""

    users: float = Field(1.0, gt=0, description="relative share of the simulated users")


class WorkloadConfig(_Strict):
    prompts: int = Field(48, ge=1, description="size of the prompt pool")
    prompt_len: tuple[int, int] = Field((8, 48), description="prompt lengths (uniform range, tokens)")
    seed: int = 0


class LoadTestConfig(_Strict):
    name: str = "custom"
    description: str = ""
    target: str = Field("tiny", description="a key of TARGETS, recorded in the report")
    app: dict = Field(default_factory=dict, description="AppConfig args for build_app (tenants included)")
    request_path: RequestPathConfig = Field(default_factory=RequestPathConfig,
                                            description="how requests reach the router (Serve's ingress options)")
    user: UserModel = Field(default_factory=UserModel)
    tenants: dict[str, TenantLoad] = Field(default_factory=dict,
                                           description="user shares; default: every app tenant, equal shares")
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    kill_verifier_at_s: float | None = Field(None, description="kill one verifier replica this long after start")
    kill_verifier_every_s: float | None = Field(None, gt=0, description="and again every this many seconds")
    fairness: bool = Field(False, description="check per-tenant token share against weights")
    max_shed_ms: tuple[float, float] | None = Field(None, description="check: 429s answered within these "
                                                                   "p50 and p99 (ms)")
    expect_shed: bool = Field(False, description="check: the run must shed (429) at all")
    max_verify_p99_ms: float | None = Field(None, description="check: admitted verify rounds' steady p99 (ms)")
    max_rss_growth: float | None = Field(None, description="check: router/verifier RSS growth over the window")
    warmup_s: float = Field(3.0, ge=0, description="excluded from steady-state figures after all users spawned")
    spawn_at_once: bool = Field(False, description="every user started at once (the spawn rate is the user count): "
                                                   "a cold start's traffic")
    max_idle_open_refusals: int | None = Field(None, ge=0, description="check: at most this many opens refused for "
                                                                       "their deadline while the verifier had "
                                                                       "nothing pending")
    # multi-node faults (issue 65; loadtests/cluster.py): the app on a head + worker nodes of this machine
    cluster_workers: int = Field(0, ge=0, le=8, description="worker nodes beside the head (0: one local Ray node); "
                                                              "each its own raylet, CPUs and Serve proxy")
    gcs_ft: bool = Field(False, description="the head's GCS on a real Redis (redis-server), as KubeRay's GCS FT")
    kill_node_at_s: float | None = Field(None, description="SIGKILL a worker node holding a verifier replica this "
                                                           "long after start")
    kill_node_every_s: float | None = Field(None, gt=0, description="and again every this many seconds")
    node_back_after_s: float = Field(30.0, ge=0, description="a new worker node joins this long after each kill")
    gcs_restart_at_s: float | None = Field(None, description="SIGKILL the head's gcs_server this long after start "
                                                             "(needs gcs_ft) and start it again gcs_down_s later")
    gcs_down_s: float = Field(10.0, ge=0)
    max_recovery_s: float | None = Field(None, description="check: Serve back to the verifier replica count within "
                                                           "this long after each node's return")

    @model_validator(mode="after")
    def _check(self):
        cfg = self.app_config()
        keys = {t.get("name"): t for t in self.app.get("router", {}).get("tenants", [])}
        for t in self.tenants:
            if t not in keys:
                raise ValueError(f"user share for unknown tenant {t!r}")
        if cfg.router.tenants_file and not keys:
            raise ValueError("the load test needs plain API keys: list tenants in app.router.tenants")
        for name, t in keys.items():
            if "api_key" not in t:
                raise ValueError(f"tenant {name!r}: the load test needs its plain api_key")
        if self.gcs_restart_at_s is not None and not self.gcs_ft:
            raise ValueError("gcs_restart_at_s needs gcs_ft (without Redis the cluster dies with its GCS)")
        if self.kill_node_at_s is not None and self.cluster_workers < 1:
            raise ValueError("kill_node_at_s needs cluster_workers >= 1")
        if self.cluster_workers and self.request_path.ingress.value != "proxy":
            raise ValueError("cluster_workers: request_path.ingress proxy (Serve's proxy on every node; the router "
                             "replicas' own ports would collide on one machine)")
        return self

    def app_config(self) -> AppConfig:
        return AppConfig(**self.app)

    def tenant_keys(self) -> dict[str, str]:
        """Tenant name -> plain API key, from the app config (the dev key when none is configured)."""
        tenants = self.app.get("router", {}).get("tenants", [])
        if not tenants:
            from deploy.config import DEV_API_KEY

            return {"dev": DEV_API_KEY}
        return {t["name"]: t["api_key"] for t in tenants}

    def tenant_weights(self) -> dict[str, float]:
        return {t.name: t.weight for t in self.app_config().router.load_tenants()}

    def user_shares(self) -> dict[str, float]:
        keys = self.tenant_keys()
        shares = {n: t.users for n, t in self.tenants.items()} or {n: 1.0 for n in keys}
        total = sum(shares.values())
        return {n: s / total for n, s in shares.items()}

    @classmethod
    def from_yaml(cls, path: str | Path) -> "LoadTestConfig":
        return cls(**(yaml.safe_load(Path(path).read_text()) or {}))


def _tenant(name: str, weight: float, users: int = 100_000) -> dict:
    # quotas far above any user count: scenarios measure the verifier, not the quota
    return {"name": name, "api_key": f"loadtest-{name}-key", "weight": weight, "max_sessions": users}


def _app(target: str, **verifier) -> dict:
    v = {"num_replicas": 1, "max_batch_sessions": 32, "batch_wait_ms": 2.0, "torch_threads": 1,
         "max_tree_nodes": 64, "num_cpus": 0.5}
    v.update(verifier)
    return {"target": copy.deepcopy(TARGETS[target]), "verifier": v,
            "router": {"max_pending_verifies": 512, "tenants": [_tenant("default", 1.0)]},
            "server_draft": {"enabled": False}}


SCENARIOS: tuple[str, ...] = ("ramp", "cold-start", "edge", "tenants", "tenants-objective", "burst", "kill", "smoke", "soak",
                               "chaos")


def edge_user(**overrides) -> UserModel:
    """Users that behave like the edge agent fleet: one WebSocket per session, half RTX-class and
    half Jetson-class drafters, RTTs log-normal around 40 ms, a person's think time between
    generations (5-30 s)."""
    base = dict(devices={"rtx4090": 1.0, "jetson-orin": 1.0}, rtt_ms=40.0, rtt_sigma=0.5, ws_share=1.0,
                idle_s=(5.0, 30.0))
    return UserModel(**{**base, **overrides})


def scenario(name: str, target: str = "tiny") -> LoadTestConfig:
    """The built-in scenarios (the issue's list), for ``--scenario``."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose from {sorted(TARGETS)}")
    app = _app(target)
    if name == "ramp":
        return LoadTestConfig(name=name, target=target, app=app,
                              description="ramp to N users of one tenant; defaults of a production config")
    if name == "cold-start":
        return LoadTestConfig(name=name, target=target, app=app, spawn_at_once=True, max_idle_open_refusals=0,
                              description="the app just started and every user opening at once: no open refused "
                                          "for its deadline while the verifier is idle (issue 67)")
    if name == "edge":
        return LoadTestConfig(name=name, target=target, app=app, user=edge_user(), max_shed_ms=(50.0, 100.0),
                              max_verify_p99_ms=1000.0, description="edge-agent-like users (WebSocket, device draft profiles, RTT spread, "
                                          "think time) against a production config")
    if name == "soak":
        app = _app(target, num_replicas=2)
        return LoadTestConfig(name=name, target=target, app=app, user=edge_user(idle_s=(1.0, 5.0)),
                              kill_verifier_at_s=300.0, kill_verifier_every_s=300.0, max_rss_growth=0.05,
                              warmup_s=120.0, description="a long run at a steady load with a "
                              "verifier replica killed every 5 minutes: nothing lost, nothing leaks")
    if name == "chaos":
        # a head + 2 worker nodes, one verifier replica each, two routers; a worker node SIGKILLed every 4 min (a new
        # one joins 30 s later) and the head's GCS restarted from Redis once, 10 min in (make chaos: 20 min)
        app = _app(target, num_replicas=3, max_replicas_per_node=1)
        app["router"]["num_replicas"] = 2
        return LoadTestConfig(name=name, target=target, app=app, user=edge_user(idle_s=(1.0, 5.0)),
                              request_path=RequestPathConfig(ingress="proxy"), cluster_workers=2, gcs_ft=True,
                              kill_node_at_s=240.0, kill_node_every_s=240.0, node_back_after_s=30.0,
                              gcs_restart_at_s=600.0, gcs_down_s=10.0, max_recovery_s=120.0, warmup_s=30.0,
                              description="worker nodes killed and the head's GCS restarted under edge users: "
                                          "nothing lost or duplicated, nothing diverged, Serve restores the "
                                          "replicas (loadtests/cluster.py)")
    if name in ("tenants", "tenants-objective", "smoke"):
        # weights matter only when the verifier is the bottleneck: one session per forward on a target
        # with real compute per token (on 2 cores the HTTP proxy saturates before a "tiny" verifier does),
        # many users with a short think time
        if target == "tiny":
            target = "tiny-wide"
        app = _app(target, max_batch_sessions=1, batch_wait_ms=0.0)
        app["router"]["tenants"] = [_tenant("gold", 3.0), _tenant("bronze", 1.0)]
        # no router-side shedding (no cap, no latency objective): the verifier's weighted-fair queue decides;
        # tenants-objective keeps the production latency objective (p99 1 s): the router sheds too, by weight
        app["router"].update(max_pending_verifies=4096, max_queued_batches=None, latency_objective_s=None)
        if name == "tenants-objective":
            del app["router"]["latency_objective_s"]
        # the smoke run (make test) speaks both transports: half the users POST, half use WebSockets
        user = UserModel(draft_ms=2.0, rtt_ms=2.0, depth=4, nodes=32, max_tokens=32, idle_s=(0.0, 0.05),
                         ws_share=0.5 if name == "smoke" else 0.0)
        desc = ("mixed tenants gold (weight 3) and bronze (weight 1), equal user counts, verifier saturated "
                "(max_batch_sessions=2): tokens served must split 3:1"
                + (", with the router's latency objective on (p99 1 s)" if name == "tenants-objective" else ""))
        return LoadTestConfig(name=name, target=target, app=app, user=user, fairness=True, description=desc,
                              warmup_s=2.0 if name == "smoke" else 3.0)
    if name == "burst":
        # far more users than the verifier holds, a short router queue: excess load must be shed with 429 fast
        app = _app(target, max_batch_sessions=8)
        app["router"]["max_pending_verifies"] = 32
        user = UserModel(draft_ms=2.0, rtt_ms=2.0, idle_s=(0.0, 0.2), max_tokens=32)
        return LoadTestConfig(name=name, target=target, app=app, user=user, max_shed_ms=(500.0, 2000.0),
                              expect_shed=True,
                              description="burst above capacity: the router sheds with 429 + Retry-After, "
                                          "fast (p50 under 0.5 s, p99 under 2 s), and nothing times out")
    if name == "kill":
        app = _app(target, num_replicas=2)
        user = UserModel(idle_s=(0.2, 1.0))
        return LoadTestConfig(name=name, target=target, app=app, user=user, kill_verifier_at_s=20.0,
                              description="two verifier replicas, one killed mid-run: its sessions re-open "
                                          "with their history on the other (or the restarted) replica")
    raise ValueError(f"unknown scenario {name!r}; choose from {SCENARIOS}")
