"""The KV pool's size from device memory, as vLLM's ``gpu_memory_utilization`` gives it.

What the weights, activations and CUDA graphs leave, capped by ``verifier.kv_budget_tokens`` (docs/verifier.md)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from specdec.model.cuda.graphs import ROW_BUCKETS

GIB = 1 << 30
GRAPH_ROWS = ROW_BUCKETS[-1]  # the largest CUDA graph


class DoesNotFit(ValueError):
    """The target's weights and one ``max_model_len`` session do not fit the memory it may use."""


# -- shapes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What memory depends on in a decoder's ``config.json`` (Llama, Mistral, Qwen2/3)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of q and k

    @classmethod
    def of(cls, config) -> "Shape":
        """From a config object (attributes) or a ``config.json`` dict."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        return cls(get("num_hidden_layers"), get("hidden_size"), heads, get("num_key_value_heads") or heads,
                   get("head_dim") or get("hidden_size") // heads, get("intermediate_size"), get("vocab_size"),
                   bool(get("tie_word_embeddings", False)),
                   get("model_type") == "qwen2" or bool(get("attention_bias", False)), get("model_type") == "qwen3")

    def per_rank(self, tp: int) -> "Shape":
        """What the busiest of ``tp`` tensor-parallel ranks holds (specdec/model/tensor_parallel.py): its query and
        KV heads (KV heads split, rounded up, or one replicated), intermediate size and vocabulary over ``tp``; the
        hidden size and norms whole. Weights, KV and activations of this shape are one rank's."""
        if tp == 1:
            return self
        kv = -(-self.num_kv_heads // tp) if self.num_kv_heads >= tp else 1
        heads = kv * (self.num_heads // self.num_kv_heads) if self.num_kv_heads >= tp else self.num_heads // tp
        return replace(self, num_heads=heads, num_kv_heads=kv, intermediate_size=-(-self.intermediate_size // tp),
                       vocab_size=-(-self.vocab_size // tp))

    def layer_params(self) -> int:
        D, d = self.hidden_size, self.head_dim
        qkv = D * (self.num_heads + 2 * self.num_kv_heads) * d
        bias = (self.num_heads + 2 * self.num_kv_heads) * d if self.qkv_bias else 0
        norms = 2 * D + (2 * d if self.qk_norm else 0)
        return qkv + bias + self.num_heads * d * D + 3 * D * self.intermediate_size + norms

    def weight_bytes(self, dtype_bytes: int, first: int = 0, last: int | None = None) -> int:
        """Parameters of layers ``[first, last)``, the embedding in the first stage, final norm and head in the last."""
        last = self.num_layers if last is None else last
        embed = self.vocab_size * self.hidden_size
        n = (last - first) * self.layer_params()
        n += embed if first == 0 else 0
        if last == self.num_layers:
            n += self.hidden_size + (0 if self.tied and first == 0 else embed)
        return n * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int, num_layers: int | None = None) -> int:
        """K and V of one token in ``num_layers`` layers (all by default)."""
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * self.num_kv_heads * self.head_dim * dtype_bytes


def activation_bytes(shape: Shape, rows: int, logit_rows: int, dtype_bytes: int) -> int:
    """Peak transient bytes of one forward of ``rows`` packed rows with ``logit_rows`` logits rows."""
    s = shape
    per_row = 2 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim \
        + 3 * s.intermediate_size
    return rows * per_row * dtype_bytes + logit_rows * s.vocab_size * (dtype_bytes + 4)


# -- the plan -------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryUse:
    """Bytes of the device memory a replica (or stage) may use, and what holds it besides the KV."""

    device: str
    total: int  # the device's memory (host, or its cgroup's limit, on a CPU)
    utilization: float
    weights: int
    activations: int  # the largest forward's transient tensors
    graphs: int  # CUDA graphs' private pool (0 without graphs)
    other: int  # held by others: the CUDA context, other processes on the device

    @property
    def budget(self) -> int:
        return int(self.utilization * self.total)

    @property
    def for_kv(self) -> int:
        return self.budget - self.weights - self.activations - self.graphs - self.other


@dataclass(frozen=True)
class KVPlan:
    """The pool's capacity and the sessions' eviction budget, in tokens."""

    capacity_tokens: int  # the pool: budget + one batch of new tokens
    budget_tokens: int  # committed KV above which sessions are evicted (LRU)
    max_model_len: int
    kv_bytes_per_token: int
    memory: MemoryUse | None  # None: sized by kv_budget_tokens alone (no memory figures)
    capped: bool  # kv_budget_tokens, not memory, set the size

    @property
    def sessions(self) -> int:
        """Capacity in sessions of ``max_model_len`` tokens."""
        return self.budget_tokens // self.max_model_len

    def stats(self) -> dict:
        out = {"kv_pool_tokens": self.capacity_tokens, "kv_budget_tokens": self.budget_tokens,
               "kv_capacity_sessions": self.sessions, "max_model_len": self.max_model_len,
               "kv_bytes_per_token": self.kv_bytes_per_token, "kv_capped": self.capped}
        if self.memory is not None:
            out["memory"] = {**asdict(self.memory), "budget": self.memory.budget, "for_kv": self.memory.for_kv}
        return out

    def describe(self) -> str:
        m = self.memory
        head = (f"KV pool {self.capacity_tokens:,} tokens ({self.budget_tokens:,} for sessions: "
                f"{self.sessions:,} of max_model_len {self.max_model_len:,}; "
                f"{_gib(self.capacity_tokens * self.kv_bytes_per_token)})")
        if m is None:
            return head + " from verifier.kv_budget_tokens"
        return (head + f"{' capped by verifier.kv_budget_tokens' if self.capped else ''}; {m.device}: "
                f"{m.utilization:.2f} x {_gib(m.total)} = {_gib(m.budget)}, weights {_gib(m.weights)}, "
                f"activations {_gib(m.activations)}, CUDA graphs {_gib(m.graphs)}, other {_gib(m.other)}")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB // 10 or n == 0 else f"{n / (1 << 20):.1f} MiB"


def plan(memory: MemoryUse | None, kv_bytes_per_token: int, max_model_len: int, batch_room_tokens: int,
         cap_tokens: int | None) -> KVPlan:
    """The pool for ``memory`` (None: ``cap_tokens`` alone): KV tokens left, at most ``cap_tokens + batch_room_tokens``;
    the sessions' budget one batch less; :class:`DoesNotFit` below one ``max_model_len`` session and one batch."""
    if memory is None and cap_tokens is None:
        raise ValueError("a KV plan needs the device memory or verifier.kv_budget_tokens")
    fit = memory.for_kv // kv_bytes_per_token if memory is not None else None
    want = cap_tokens + batch_room_tokens if cap_tokens is not None else None
    need = max_model_len + batch_room_tokens
    if fit is not None and fit < need:  # an explicit cap below one session is the operator's choice
        m = memory
        raise DoesNotFit(
            f"the target does not fit: one session of max_model_len {max_model_len:,} tokens plus one batch "
            f"({batch_room_tokens:,} tokens) needs {need:,} KV tokens = {_gib(need * kv_bytes_per_token)} at "
            f"{kv_bytes_per_token:,} bytes a token, but {m.device} gives {m.utilization:.2f} x {_gib(m.total)} = "
            f"{_gib(m.budget)}, of which weights take {_gib(m.weights)}, activations {_gib(m.activations)}, "
            f"CUDA graphs {_gib(m.graphs)} and other holders {_gib(m.other)}, leaving {_gib(max(m.for_kv, 0))} "
            f"({max(fit, 0):,} tokens). Raise verifier.gpu_memory_utilization, lower target.max_model_len or "
            f"verifier.max_batch_tokens, or shard the target (verifier.pipeline_parallel_size)")
    capacity = min(x for x in (fit, want) if x is not None)
    return KVPlan(capacity, capacity - batch_room_tokens, max_model_len, kv_bytes_per_token, memory,
                  want is not None and (fit is None or want <= fit))


# -- measuring ------------------------------------------------------------------------
def device_memory(device: str | torch.device) -> int:
    """Bytes of memory ``device`` has: a GPU's total; on a CPU the host's, or its cgroup's limit."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[1]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (shared tensors once)."""
    seen: dict[int, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if not t.is_meta:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def probe_forward(model, rows: int, max_model_len: int, logit_rows: int) -> int:
    """One forward of ``rows`` prompt rows through ``model`` on a scratch pool; returns the pool's bytes."""
    from specdec.model.batch import chunk_input, pack

    pool = model.new_pool(rows + 64 * ((rows + max_model_len - 1) // max_model_len))
    items, left, i = [], rows, 0
    while left > 0:
        n = min(left, max_model_len)
        share = min(n, max(1, logit_rows * n // rows))
        items.append(chunk_input(f"probe{i}", 0, [0] * n, list(range(n - share, n))))
        pool.reserve(f"probe{i}", n)
        left, i = left - n, i + 1
    batch = pack(items, pool)
    graphs, model.graphs = model.graphs, None  # eager: a graph captured on a scratch pool would be wasted
    try:
        h = model.forward(batch, pool)
        if model.is_last:
            model.logits(h[batch.logit_index.to(h.device)])
    finally:
        model.graphs = graphs
    return pool.k.numel() * pool.k.element_size() + pool.v.numel() * pool.v.element_size()


def measure(model, loaded_model: torch.nn.Module, utilization: float, max_batch_tokens: int,
            max_model_len: int, logit_rows: int) -> MemoryUse:
    """What the device holds besides the KV pool for ``model``: measured on CUDA, from the shapes on a CPU."""
    dev = torch.device(model.device)
    dtype_bytes = model.dtype.itemsize
    if dev.type != "cuda":
        shape = Shape.of(model.config)
        act = activation_bytes(shape, max_batch_tokens, min(logit_rows, max_batch_tokens), dtype_bytes)
        return MemoryUse("cpu", device_memory(dev), utilization, tensor_bytes(loaded_model), act, 0, 0)
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    weights = torch.cuda.memory_allocated(dev)
    other = max(0, total - free - torch.cuda.memory_reserved(dev))
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        scratch = probe_forward(model, max_batch_tokens, max_model_len, logit_rows)
    torch.cuda.synchronize(dev)
    act = max(0, torch.cuda.max_memory_allocated(dev) - weights - scratch)
    torch.cuda.empty_cache()
    graphs = act * min(GRAPH_ROWS, max_batch_tokens) // max_batch_tokens if model.graphs is not None else 0
    return MemoryUse(f"cuda:{dev.index or 0}", total, utilization, weights, act, graphs, other)


@dataclass(frozen=True)
class Sizing:
    """What sizing a pool takes from the config (picklable: pipeline stages get it)."""

    utilization: float
    max_batch_tokens: int
    logit_rows: int  # logits rows of the largest forward: every session's tree
    max_model_len: int | None  # None: the checkpoint's context
    batch_room_tokens: int
    cap_tokens: int | None

    @classmethod
    def of(cls, vc, max_model_len: int | None) -> "Sizing":
        """From a :class:`deploy.config.VerifierConfig` and the context the engine serves."""
        return cls(vc.gpu_memory_utilization, vc.max_batch_tokens, vc.max_batch_sessions * (vc.max_tree_nodes + 1),
                   max_model_len, vc.batch_room_tokens(), vc.kv_budget_tokens)

    def plan(self, model, loaded_model: torch.nn.Module) -> KVPlan:
        """The pool of ``model`` (a DecoderModel or a stage's slice) from what :func:`measure` finds, or DoesNotFit."""
        logits = self.logit_rows if model.is_last else 0
        max_len = self.max_model_len or getattr(model.config, "max_position_embeddings", 1 << 16)
        memory = measure(model, loaded_model, self.utilization, self.max_batch_tokens, max_len, logits)
        kv_bytes = 2 * model.num_local_layers * model.spec.num_kv_heads * model.spec.head_dim * model.dtype.itemsize
        return plan(memory, kv_bytes, max_len, self.batch_room_tokens, self.cap_tokens)


def max_len_of(loaded, max_model_len: int | None) -> int:
    """The context the engine serves: ``target.max_model_len``, else the checkpoint's."""
    return max_model_len or getattr(loaded.model.config, "max_position_embeddings", 1 << 16)


def sized_runner(loaded, vc, max_model_len: int | None):
    """What a replica runs at start: ``(ModelRunner, KVPlan)``, its pool sized from the memory it may use.
    ``vc``: a :class:`deploy.config.VerifierConfig`; ``max_model_len`` None: the checkpoint's context."""
    from specdec.model.decoder import DecoderModel
    from specdec.model.runner import ModelRunner

    model = DecoderModel(loaded.model, compile=vc.compile, attention_backend=vc.attention_backend)
    model.share_weights(loaded.model)  # the weights once, before they are measured
    try:
        p = Sizing.of(vc, max_len_of(loaded, max_model_len)).plan(model, loaded.model)
    except DoesNotFit as e:
        raise DoesNotFit(f"{loaded.name}: {e}") from None
    return ModelRunner(model, kv_capacity_tokens=p.capacity_tokens, compile=vc.compile,
                       prefix_caching=vc.prefix_caching), p


def check_stage(model, loaded_model: torch.nn.Module, sizing: Sizing, capacity_tokens: int, name: str) -> KVPlan:
    """A pipeline stage's check at start: its pool of ``capacity_tokens`` must fit its memory, else DoesNotFit."""
    where = f"{name} layers [{model.first}, {model.last})"
    try:
        p = sizing.plan(model, loaded_model)
    except DoesNotFit as e:
        raise DoesNotFit(f"{where}: {e}") from None
    if p.capacity_tokens < capacity_tokens:
        raise DoesNotFit(f"{where}: verifier.kv_budget_tokens {sizing.cap_tokens:,} plus one batch needs "
                         f"{capacity_tokens:,} KV tokens, the stage's memory holds {p.capacity_tokens:,} "
                         f"({p.describe()}). Lower verifier.kv_budget_tokens, raise "
                         f"verifier.gpu_memory_utilization or add stages")
    return p


def cap_plan(loaded, vc, max_model_len: int | None) -> KVPlan:
    """The pool ``verifier.kv_budget_tokens`` alone gives (pipeline stages check it: :func:`check_stage`)."""
    kv_bytes = Shape.of(loaded.model.config).kv_bytes_per_token(loaded.dtype.itemsize)
    return plan(None, kv_bytes, max_len_of(loaded, max_model_len), vc.batch_room_tokens(), vc.kv_budget_tokens)
