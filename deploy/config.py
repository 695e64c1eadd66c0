"""All configuration of the cloud side, typed and validated in one place.

``serve run deploy.app`` uses the defaults; config files and the Helm chart pass ``args`` validated as AppConfig."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEV_API_KEY = "specedge-dev-key"  # only when no tenants are configured; logged as a warning


BASE_ALIAS = "base"  # what a request's `model` may say for the base target (never a version's name)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    """Which target to load (see :func:`specdec.model.loading.load_model`)."""

    model: str = Field("embedded", description="'embedded', 'tiny-random', a .gguf file, an HF dir or id")
    tokenizer: str | None = Field(None, description="tokenizer source when it differs from the model")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    attn_implementation: Literal["auto", "sdpa", "eager"] = Field(
        "auto", description="the Hugging Face attention of the loaded model (reference decoding only; the verifier "
                            "runs its own tree attention). flash_attention_2 is refused: it ignores tree masks")
    seed: int = 0
    tiny_config: dict | None = Field(None, description="overrides for tiny-random (vocab_size, num_layers, ...)")
    max_model_len: int | None = Field(None, ge=16)
    adapters: dict[str, str] = Field(
        default_factory=dict, description="target versions served beside the base (FlexSpec): name -> PEFT LoRA "
                                          "adapter directory (adapter_config.json + adapter_model.safetensors); a "
                                          "session picks one by `model`; all versions share every batch. Changed "
                                          "without a restart (the verifier's reconfigure)")
    max_loaded_adapters: int = Field(4, ge=1, description="versions held in memory per replica: loaded on first "
                                                          "use, least recently used evicted beyond this")

    @field_validator("adapters")
    @classmethod
    def _version_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}", name):
                raise ValueError(f"target version name {name!r}: 1-64 of A-Z a-z 0-9 _ . : - (a letter or digit first)")
            if not path:
                raise ValueError(f"target version {name!r}: empty adapter path")
        return v

    @model_validator(mode="after")
    def _not_the_base(self):
        for name in (self.model, BASE_ALIAS):
            if name in self.adapters:
                raise ValueError(f"target version {name!r} has the base model's name")
        return self


class EarlyExitConfig(_Strict):
    """Exit heads in the verify forward (the early-exit paper): edges that ask (``F_EARLY``) get guesses mid-forward."""

    enabled: bool = Field(False, description="load exit heads and answer F_EARLY requests; off: such requests 400")
    heads: str = Field("embedded", description="exit-head artifact: 'embedded' (deploy/artifacts, trained for "
                                               "SmolLM2-135M by benchmarks/train_exit_heads.py), a .safetensors "
                                               "path, or 'untrained' (logit-lens heads, for tests)")
    layers: list[int] | None = Field(None, min_length=1, max_length=16,
                                     description="exits to run (layers run before each); null: all of the "
                                                 "artifact's ('untrained' needs them)")

    @model_validator(mode="after")
    def _layers(self):
        if self.layers is not None and (any(x < 1 for x in self.layers) or len(set(self.layers)) != len(self.layers)):
            raise ValueError("early_exit.layers must be distinct layer counts >= 1")
        if self.enabled and self.heads == "untrained" and not self.layers:
            raise ValueError("early_exit.heads 'untrained' needs early_exit.layers")
        return self


class VerifierConfig(_Strict):
    num_replicas: int = Field(1, ge=1)
    max_batch_sessions: int = Field(16, ge=1, le=1024)
    max_batch_tokens: int = Field(2048, ge=1)
    batch_wait_ms: float = Field(2.0, ge=0, le=1000, description="how long to wait to fill a batch; skipped when "
                                                                 "every session already has a round queued")
    batch_fill: float = Field(2.0, ge=0, le=4, description="also wait for sessions due back (by their measured "
                                                           "away time) within this multiple of the forward's "
                                                           "predicted time; 0 = off (deploy/verifier/batch_fill.py)")
    max_tree_nodes: int = Field(64, ge=1, le=1024)
    max_tree_depth: int = Field(32, ge=1, le=1024)
    max_prompt_tokens: int = Field(8192, ge=1)
    grammar_compile_timeout_s: float = Field(10.0, gt=0, le=600, description="an open's grammar (structured "
                                             "output) not compiled within this: a 400 (deploy/verifier/grammars.py)")
    grammar_cache_mb: float = Field(256.0, gt=0, description="compiled grammars kept (LRU) up to this size")
    kv_budget_tokens: int | None = Field(262_144, ge=256, description="a cap: LRU-evict sessions above this many "
                                                                      "KV tokens, the pool holding this plus one "
                                                                      "batch, unless memory gives less; null: as "
                                                                      "many as gpu_memory_utilization gives")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="the share of the device's memory this "
                                                                       "replica (or each stage) may use (vLLM's "
                                                                       "meaning; on CPU the host's): the KV pool "
                                                                       "gets what the weights, the largest forward "
                                                                       "and the CUDA graphs leave "
                                                                       "(deploy/verifier/kv_sizing.py)")
    prefill_chunk_tokens: int = Field(256, ge=1, description="most prompt tokens per forward while verify rounds "
                                                              "wait (chunked prefill); max_batch_tokens otherwise")
    attention_backend: Literal["triton", "sdpa"] = Field(
        "triton", description="the tree attention on CUDA. triton: the batch-invariant Triton kernel, where it runs; "
                              "where it cannot (no Triton, a card outside the classes it is compiled for: "
                              "specdec/model/cuda/plan.py CARD_CLASSES) sdpa instead, with one log line saying why. "
                              "sdpa: torch's scaled_dot_product_attention over the gathered pages with the tree mask: "
                              "exact for greedy and sampled output (the target's own logits) but not bit-invariant "
                              "across batch compositions (docs/gpu_attention.md, \"Portable fallback\")")
    compile: bool = Field(False, description="torch.compile the forward's elementwise glue (dynamic shapes; "
                                             "compiled at replica start, ~1 min on CPU) in place of the native C "
                                             "glue (CPU bf16) or eager torch. Off: it does not pay on CPU")
    prefill_share: float = Field(0.2, gt=0, le=4, description="while verify rounds wait, a prefill chunk takes at "
                                                              "most this share of a verify forward's time per "
                                                              "session waiting to be prefilled")
    max_sessions: int = Field(4096, ge=1)
    warmup: bool = Field(True, description="one prefill and one verify forward on dummy tokens before the replica "
                                           "reports ready: the first user does not pay for initialisation")
    idle_timeout_s: float = Field(600.0, gt=0)
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    max_replicas_per_node: int | None = Field(
        None, ge=1, le=100, description="Serve's max_replicas_per_node for the verifier replicas: 1 spreads them "
                                        "one per Ray node, so a node's loss takes one replica's sessions (they "
                                        "re-open on the others); null: Serve places them (one stage only: pipeline "
                                        "stages are placed by their placement group)")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="ranks the target (or each pipeline stage) is "
                                      "sharded over, Megatron-style, as vLLM names it: one GPU (num_gpus_per_stage "
                                      "each) or num_cpus each; a replica holds tensor x pipeline size devices in "
                                      "one STRICT_PACK placement group (docs/tensor_parallel.md)")
    num_cpus: float = Field(1.0, ge=0)
    num_gpus_per_stage: float = Field(0.0, ge=0)
    torch_threads: int | None = Field(None, ge=1)
    max_ongoing_requests: int = Field(1024, ge=1)
    version_affinity_margin: int = Field(4, ge=0, description="an open of a target version prefers the replicas "
                                                              "holding it loaded while their load (sessions + "
                                                              "pending) is within this many of the least-loaded "
                                                              "replica's; beyond it, the least loaded "
                                                              "(deploy/router/affinity.py)")
    chain_top_k: int = Field(64, ge=1, le=4096,
                             description="rejection rule: most entries of p per rejection reply (all of p when its "
                                         "support fits; else up to K head entries and K tail candidates); exact "
                                         "for any K, only the bytes and refill round trips change")
    rule_modules: list[str] = Field(default_factory=list, description="Python modules imported at start, each "
                                                                      "registering verify rules beyond the built-in "
                                                                      "ones (specdec/rules.py)")
    truncate_trees: bool = Field(True, description="per batch, verify the prefix of each priority-ordered tree that "
                                                   "maximises expected tokens per forward second "
                                                   "(specdec/truncation.py)")
    run_ahead_tokens: int = Field(8, ge=0, le=1024,
                                  description="while the tree budget is 0, decode a session that asks (F_AHEAD) on "
                                              "past its bonus for up to this many tokens in the following forwards, "
                                              "and reply once with all of them; 0 = off (deploy/verifier/run_ahead.py)")
    prefix_caching: bool = Field(True, description="share the KV pages of a prompt's prefix computed before (a "
                                                   "system prompt, an earlier turn) within a tenant and target "
                                                   "version; exact: specdec/model/prefix_cache.py")
    prefix_affinity_margin: int = Field(4, ge=0, description="an open whose prompt begins like an earlier open's "
                                                             "prefers that open's replica while its load is within "
                                                             "this many of the least-loaded replica's "
                                                             "(deploy/router/affinity.py)")
    early_exit: EarlyExitConfig = Field(default_factory=EarlyExitConfig)

    @model_validator(mode="after")
    def _sdpa_is_one_process(self):
        if self.attention_backend == "sdpa" and (self.pipeline_parallel_size > 1 or self.tensor_parallel_size > 1):
            raise ValueError("verifier.attention_backend sdpa is chosen for one-process replicas; pipeline stages and "
                             "tensor-parallel ranks take the automatic choice (triton, sdpa where it cannot run)")
        return self

    def batch_room_tokens(self) -> int:
        """Pool room beyond the sessions' budget for one full batch (every session's tree, each on a fresh page)."""
        return self.max_batch_tokens + 16 * self.max_batch_sessions * 2

    def kv_pool_tokens(self) -> int:
        """Pool capacity by the cap alone: the eviction budget plus one batch (pipeline stages)."""
        if self.kv_budget_tokens is None:
            raise ValueError("verifier.kv_budget_tokens is null: the pool is sized from memory")
        return self.kv_budget_tokens + self.batch_room_tokens()


class TenantConfig(_Strict):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    api_key_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    api_key: str | None = Field(None, min_length=8, description="plain key (dev only); hashed on load")
    weight: float = Field(1.0, gt=0)
    max_sessions: int = Field(64, ge=1)
    tokens_per_second: float = Field(0.0, ge=0, description="token-rate limit, 0 = unlimited")
    burst_tokens: float = Field(0.0, ge=0, description="bucket size; 0 = 10 s worth of tokens")
    kv_quota_tokens: int | None = Field(None, ge=16, description="KV tokens this tenant's sessions may hold per "
                                                                 "verifier replica (its LRU sessions are evicted "
                                                                 "above it); null: only the replica's budget, "
                                                                 "where a tenant over its weight's share goes first")

    @model_validator(mode="after")
    def _hash_key(self):
        if (self.api_key is None) == (self.api_key_sha256 is None):
            raise ValueError(f"tenant {self.name!r}: give exactly one of api_key_sha256, api_key")
        if self.api_key is not None:
            object.__setattr__(self, "api_key_sha256", hash_api_key(self.api_key))
            object.__setattr__(self, "api_key", None)
        return self


class RouterConfig(_Strict):
    num_replicas: int = Field(1, ge=1)
    max_queued_requests: int = Field(2048, ge=1, description="Serve-level queue limit (then 503/429)")
    max_ongoing_requests: int = Field(
        4096, ge=1, description="concurrent requests per router replica; keep it above the client count, or "
                                "Serve's proxy queues the excess and retries it with backoff (seconds late)")
    max_pending_verifies: int = Field(512, ge=1, description="router-side shedding: ceiling on requests in "
                                                             "flight to the verifiers")
    max_queued_batches: int | None = Field(
        3, ge=0, description="shed (429) once this many full batches per verifier replica wait behind the "
                             "running ones (deploy/router/admission.py); null: only max_pending_verifies")
    latency_objective_s: float | None = Field(
        1.0, gt=0, description="p99 latency objective for admitted verify rounds: the in-flight cap is fitted "
                               "to it (deploy/router/admission.py); null: the static cap only")
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After while shedding is rare")
    max_retry_after_s: float = Field(30.0, gt=0, description="Retry-After ceiling under sustained overload")
    tenants_file: str | None = None
    tenants: list[TenantConfig] = Field(default_factory=list)
    max_body_bytes: int = Field(1 << 20, ge=1024, description="413 above it, checked before and while reading")
    body_timeout_s: float = Field(10.0, gt=0, description="408 if a request body takes longer to arrive")
    ws_idle_timeout_s: float = Field(120.0, gt=0, description="close a WebSocket with no frame for this long")
    loop_stall_log_s: float = Field(2.0, ge=0, description="log the event loop's stack when it has not run for "
                                    "this long (deploy/router/probe.py); 0 = off")
    request_timeout_s: float = Field(300.0, gt=0, description="504 if one verifier call (an open with its "
                                                              "prefill, a verify round) takes longer")
    open_deadline_s: float = Field(5.0, gt=0, description="an open's prefill starts within this (its own "
                                   "prefill comes on top) or it is shed 429 with Retry-After: at the door when the "
                                   "prefill queued ahead of it predicts it, else when the verifier finds it still "
                                   "waiting (deploy/prefill_forecast.py); an idle server admits any open; the "
                                   "x-open-deadline-s header may ask for less")

    @field_validator("tenants")
    @classmethod
    def _unique(cls, v):
        _check_unique(v)
        return v

    def load_tenants(self) -> list[TenantConfig]:
        tenants = list(self.tenants)
        if self.tenants_file:
            data = yaml.safe_load(Path(self.tenants_file).read_text()) or {}
            tenants += [TenantConfig(**t) for t in data.get("tenants", [])]
        if not tenants:
            tenants = [TenantConfig(name="dev", api_key=DEV_API_KEY, max_sessions=4096)]
        _check_unique(tenants)
        return tenants


class PacingConfig(_Strict):
    """SpecEdge §4.3 pacing and the load-aware tree budget (budgets clipped to ``verifier.max_tree_nodes``)."""

    min_depth: int = Field(1, ge=1)
    max_depth: int = Field(12, ge=1)
    default_depth: int = Field(4, ge=1)
    tree_budgets: list[int] = Field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64], min_length=1,
                                    description="budget hints to choose from; 0 = no tree (plain decoding)")
    default_tree_budget: int = Field(32, ge=1)
    ema: float = Field(0.2, gt=0, le=1)
    round_overhead_ms: float = Field(
        3.0, ge=0, le=1000,
        description="server CPU a verify request costs outside the forward (proxy, router, replica, Ray), "
                    "counted against small trees when choosing the budget (3.0: benchmarks.run --full's "
                    "non-forward ms per token, results README); 0 weighs the forward alone")
    tree_margin: float = Field(
        0.10, ge=0, le=1,
        description="from 2 sessions up, a tree budget is hinted only when predicted this much better (in verified "
                    "tokens per server CPU-second) than no tree: the idle server time and per-request proxy work "
                    "that tree rounds cause are not in the prediction (deploy/verifier/pacing.py); 0: none")
    sessions_hold_s: float = Field(
        1.0, ge=0, le=60,
        description="the sessions the tree budget weighs are the most that were open within this many seconds: "
                    "between one generation and the next an edge is not gone from the load (0: the count now)")
    per_version: bool = Field(True, description="each target version (target.adapters) paces its sessions by its "
                                                "own acceptance (FlexSpec §III-C); off: one acceptance for all")
    max_draft_classes: int = Field(16, ge=0, le=1024,
                                   description="acceptance estimates kept per draft class (an open's client.draft) and "
                                               "target version; sessions of further classes, or naming none, share "
                                               "the version's; 0: one estimate for every draft")

    @model_validator(mode="after")
    def _ranges(self):
        if not self.min_depth <= self.default_depth <= self.max_depth:
            raise ValueError("pacing needs min_depth <= default_depth <= max_depth")
        if any(b < 0 for b in self.tree_budgets) or sorted(set(self.tree_budgets)) != self.tree_budgets:
            raise ValueError("tree_budgets must be non-negative, increasing and distinct")
        return self


class ServerDraftConfig(_Strict):
    """Server-only modes (no edge draft): plain AR and server-side speculative decoding."""

    enabled: bool = True
    model: ModelConfig | None = Field(None, description="server-side draft model (e.g. embedded-draft); unset: prompt lookup")
    depth: int = Field(4, ge=1, le=32)
    sampled_rule: Literal["match", "tree-rejection"] = Field(
        "tree-rejection", description="temperature > 0 with a draft model: sample-then-match trees, or trees "
                                      "drawn from the draft with multi-draft rejection sampling (the edge "
                                      "agent's tree-rejection rule, so server_sd is measured with it too)")

    @model_validator(mode="after")
    def _no_versions(self):
        if self.model is not None and self.model.adapters:
            raise ValueError("server_draft.model: adapters are for the target only (the draft stays frozen)")
        return self


def _when(path: list[str], const, then: dict) -> dict:
    """JSON schema: if the value at ``path`` is ``const``, the object must satisfy ``then``."""
    cond: dict = {"const": const}
    for key in reversed(path):
        cond = {"properties": {key: cond}, "required": [key]}
    return {"if": cond, "then": then}


_GPU_PER_STAGE = {"properties": {"verifier": {"properties": {"num_gpus_per_stage": {"exclusiveMinimum": 0}},
                                              "required": ["num_gpus_per_stage"]}}, "required": ["verifier"]}
# the wiring checks of AppConfig._resource_wiring that a JSON schema can state (the Helm chart's schema)
WIRING_SCHEMA = {"allOf": [
    _when(["target", "device"], "cuda", _GPU_PER_STAGE),
    _when(["server_draft", "model", "device"], "cuda", {"anyOf": [
        {"properties": {"server_draft": {"properties": {"enabled": {"const": False}}, "required": ["enabled"]}}},
        {"allOf": [_GPU_PER_STAGE, {"properties": {"topology": {"const": "colocated"}}, "required": ["topology"]}]},
    ]}),
]}


class AppConfig(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra=WIRING_SCHEMA)

    target: ModelConfig = Field(default_factory=ModelConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    pacing: PacingConfig = Field(default_factory=PacingConfig)
    server_draft: ServerDraftConfig = Field(default_factory=ServerDraftConfig)
    route_prefix: str = "/"
    topology: Literal["split", "colocated"] = Field(
        "split", description="split: the router calls the verifier replicas through Serve (any number of each); "
                             "colocated: one replica holds both and the router calls the verifier in-process, "
                             "one Serve request less per verify round (needs one replica, one stage; "
                             "deploy/router/in_process.py)")
    access_log: bool = Field(True, description="Serve's per-request access log in the router and verifier "
                                               "replicas (one line per request; off for high request rates)")
    gc_gen0_threshold: int = Field(
        20_000, ge=0, description="router and verifier replicas: after startup, freeze what they hold "
                                  "(gc.freeze) and collect generation 0 after this many new objects instead "
                                  "of Python's 700 (fewer stop-the-world pauses; see deploy/gc_policy.py); "
                                  "0 keeps Python's collector as it is")

    @model_validator(mode="after")
    def _versions_need_one_stage(self):
        if self.target.adapters and self.verifier.pipeline_parallel_size > 1:
            raise ValueError("target.adapters (LoRA versions) need verifier.pipeline_parallel_size 1")
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self):
        """What tensor_parallel_size > 1 does not combine with, and whether the target splits: before anything loads."""
        vc, t = self.verifier, self.target
        tp = vc.tensor_parallel_size
        if tp == 1:
            return self
        refused = [("verifier.early_exit (exit heads read hidden states mid-forward)", vc.early_exit.enabled),
                   ("topology colocated", self.topology == "colocated"),
                   ("verifier.max_replicas_per_node (Serve refuses it with a placement group)",
                    getattr(vc, "max_replicas_per_node", None) is not None),
                   ("verifier.kv_budget_tokens null (every rank holds a pool of the cap's size)",
                    vc.kv_budget_tokens is None)]
        bad = [name for name, on in refused if on]
        if bad:
            raise ValueError(f"verifier.tensor_parallel_size {tp} does not combine with {', '.join(bad)}")
        problems = split_problems(t, tp)
        if problems:
            raise ValueError(f"target {t.model} cannot be split over verifier.tensor_parallel_size {tp}: "
                             + "; ".join(problems))
        return self

    @model_validator(mode="after")
    def _spread_needs_one_stage(self):
        if self.verifier.max_replicas_per_node is not None and self.verifier.pipeline_parallel_size > 1:
            raise ValueError("verifier.max_replicas_per_node needs verifier.pipeline_parallel_size 1 (Serve refuses it "
                             "with a placement group; spread pipelined replicas with the Kubernetes pods they fill)")
        return self

    @model_validator(mode="after")
    def _colocated_is_one_replica(self):
        if self.topology == "colocated":
            vc = self.verifier
            if vc.num_replicas != 1 or self.router.num_replicas != 1 or vc.pipeline_parallel_size != 1:
                raise ValueError("topology colocated holds the router and the verifier in one replica: it needs "
                                 "verifier.num_replicas 1, router.num_replicas 1 and verifier.pipeline_parallel_size 1 "
                                 "(use topology split to scale out)")
        return self

    @model_validator(mode="after")
    def _resource_wiring(self):
        """Mistakes in the resource wiring, refused before anything loads (each with its fix)."""
        vc, t, d = self.verifier, self.target, self.server_draft
        if t.device == "cuda" and vc.num_gpus_per_stage == 0:
            raise ValueError("target.device cuda needs verifier.num_gpus_per_stage > 0: Ray gives a replica (or "
                             "pipeline stage) no GPU otherwise")
        if d.enabled and d.model is not None and d.model.device == "cuda" and not (
                self.topology == "colocated" and vc.num_gpus_per_stage > 0):
            raise ValueError("server_draft.model.device cuda: the server-side drafter runs in the Router "
                             "deployment, which holds a GPU only with topology colocated and "
                             "verifier.num_gpus_per_stage > 0; use device cpu, or no model (prompt lookup)")
        if vc.pipeline_parallel_size > 1 and vc.kv_budget_tokens is None:
            raise ValueError("verifier.pipeline_parallel_size > 1 needs verifier.kv_budget_tokens: pipeline "
                             "stages hold pools of one size, the cap's (each checks at start that it fits its device)")
        layers, context = _checkpoint_dims(t)
        if layers is not None and vc.pipeline_parallel_size > layers:
            raise ValueError(f"verifier.pipeline_parallel_size {vc.pipeline_parallel_size} is more stages than "
                             f"the target's {layers} layers")
        if context is not None and t.max_model_len is not None and t.max_model_len > context:
            raise ValueError(f"target.max_model_len {t.max_model_len} is beyond the checkpoint's context "
                             f"(max_position_embeddings {context})")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppConfig":
        return cls(**(yaml.safe_load(Path(path).read_text()) or {}))


def versions_update(cfg: AppConfig, user_config) -> AppConfig:
    """``cfg`` with the target versions of a Serve ``user_config`` (``{"adapters": {name: path}, "max_loaded_adapters":
    n}``), validated as the app's config; ``adapters`` is required (``{}`` removes all). Raises ``ValueError``."""
    if not isinstance(user_config, dict) or "adapters" not in user_config:
        raise ValueError("the target versions' user_config needs an 'adapters' mapping (name -> adapter "
                         "directory; {} serves the base only)")
    unknown = sorted(set(user_config) - {"adapters", "max_loaded_adapters"})
    if unknown:
        raise ValueError(f"the target versions' user_config has unknown keys {unknown} "
                         "(adapters, max_loaded_adapters)")
    target = {**cfg.target.model_dump(), **user_config}
    return AppConfig.model_validate({**cfg.model_dump(), "target": target})


def _checkpoint_dims(target: ModelConfig) -> tuple[int | None, int | None]:
    """The target's layer count and context length, read without loading weights; None where unknown."""
    from specdec.model_source import (EMBEDDED_ALIASES, EMBEDDED_SHAPES, TINY_PREFIX, config_json, context_length,
                                      tiny_config)

    if target.model.startswith(TINY_PREFIX):
        c = tiny_config(**(target.tiny_config or {}))
        return c["num_hidden_layers"], c["max_position_embeddings"]
    if target.model in EMBEDDED_ALIASES:
        return EMBEDDED_SHAPES["num_layers"], EMBEDDED_SHAPES["max_position_embeddings"]
    c = config_json(target.model)
    return (None, None) if c is None else (c.get("num_hidden_layers"), context_length(c))


def _check_unique(tenants: list[TenantConfig]) -> None:
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ValueError(f"tenant names must be unique: {sorted(n for n in set(names) if names.count(n) > 1)}")
    keys = [t.api_key_sha256 for t in tenants]
    if len(set(keys)) != len(keys):
        raise ValueError("two tenants share one API key")


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _target_dims(target: ModelConfig) -> dict | None:
    """The target's config fields a tensor-parallel split needs, read without weights (None: unknown here)."""
    from specdec.model_source import EMBEDDED_ALIASES, EMBEDDED_SHAPES, TINY_PREFIX, config_json, tiny_config

    if target.model.startswith(TINY_PREFIX):
        return tiny_config(**(target.tiny_config or {}))
    if target.model in EMBEDDED_ALIASES:
        e = EMBEDDED_SHAPES
        return dict(num_attention_heads=e["num_heads"], num_key_value_heads=e["num_kv_heads"],
                    intermediate_size=e["intermediate_size"], vocab_size=e["vocab_size"])
    return config_json(target.model)


def split_problems(target: ModelConfig, tp: int) -> list[str]:
    """Why ``target`` cannot be split over ``tp`` tensor-parallel ranks (empty: it can, or its config is unknown)."""
    from specdec.model.shard_plan import check_shardable

    dims = _target_dims(target)
    return [] if dims is None else check_shardable(dims, tp)
