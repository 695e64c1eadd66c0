"""Which part of a Llama-family target each tensor-parallel rank holds, from its config alone (no weights, no
decoder): what must divide, each rank's heads, its config and the slices of a checkpoint it reads (issue 64;
docs/tensor_parallel.md). Used by the sharded decoder (tensor_parallel.py), the checkpoint reader and the
deployment's checks."""

from __future__ import annotations

import copy


def _get(cfg, name: str, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def check_shardable(config, tp: int) -> list[str]:
    """Why ``config`` (an HF config object or a ``config.json`` dict) cannot be split over ``tp`` ranks (empty: it
    can). Attention is split along KV groups: with at least ``tp`` KV heads each rank takes ``KV / tp`` of them
    (rounded: ranks may differ by one group, as SmolLM2's 3 KV heads over 2 ranks) and their query heads; with
    fewer, ``tp`` must be a multiple of the KV heads (each replicated on ``tp / KV`` ranks) and the query heads a
    multiple of ``tp``. The intermediate size and the vocabulary must be multiples of ``tp``."""
    if tp < 1:
        return [f"tensor_parallel_size must be >= 1 (got {tp})"]
    if tp == 1:
        return []
    heads = int(_get(config, "num_attention_heads"))
    kv = int(_get(config, "num_key_value_heads", None) or heads)
    out = []
    for name, n in (("intermediate size", int(_get(config, "intermediate_size"))),
                    ("vocabulary size", int(_get(config, "vocab_size")))):
        if n % tp:
            out.append(f"{name} {n} is not divisible by tensor_parallel_size {tp}")
    if kv < tp and (tp % kv or heads % tp):
        out.append(f"{heads} attention heads / {kv} KV heads cannot be split over {tp} ranks: with fewer KV heads "
                   f"than ranks, tensor_parallel_size must be a multiple of the KV heads and divide the heads")
    return out


def kv_heads_of(num_kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank ``rank`` of ``tp`` holds: its share (``floor`` / ``ceil`` of ``KV / tp``), or one
    replicated head when there are fewer KV heads than ranks."""
    if num_kv_heads >= tp:
        return range(num_kv_heads * rank // tp, num_kv_heads * (rank + 1) // tp)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def q_heads_of(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> range:
    """The query heads rank ``rank`` holds: those of its KV heads' groups (replicated KV: ``heads / tp`` each)."""
    if num_kv_heads >= tp:
        g = num_heads // num_kv_heads
        kvs = kv_heads_of(num_kv_heads, tp, rank)
        return range(kvs.start * g, kvs.stop * g)
    n = num_heads // tp
    return range(rank * n, (rank + 1) * n)


def local_config(config, rank: int, tp: int):
    """``config`` (a CheckpointConfig or HF config) with rank ``rank``'s head, KV-head, intermediate and vocabulary
    counts; ``full_config`` the whole one's, ``tp_shard`` ``(rank, tp)``."""
    heads, kv, d = heads_of(config)
    qs, kvs = q_heads_of(heads, kv, tp, rank), kv_heads_of(kv, tp, rank)
    local = copy.copy(config)
    local.num_attention_heads, local.num_key_value_heads, local.head_dim = len(qs), len(kvs), d
    local.intermediate_size, local.vocab_size = config.intermediate_size // tp, config.vocab_size // tp
    local.full_config, local.tp_shard = config, (rank, tp)
    return local


def shard_slicer(config, rank: int, tp: int):
    """``slicer(name) -> (dim, start, stop) | None``: the part of checkpoint tensor ``name`` rank ``rank`` keeps
    (None: whole), for reading only that from a safetensors file (``safe_open(...).get_slice``)."""
    heads, kv, d = heads_of(config)
    qs, kvs = q_heads_of(heads, kv, tp, rank), kv_heads_of(kv, tp, rank)
    i0, n_i = rank * (config.intermediate_size // tp), config.intermediate_size // tp
    v0, n_v = rank * (config.vocab_size // tp), config.vocab_size // tp
    rules = {"q_proj.weight": (0, qs.start * d, qs.stop * d), "q_proj.bias": (0, qs.start * d, qs.stop * d),
             "k_proj.weight": (0, kvs.start * d, kvs.stop * d), "k_proj.bias": (0, kvs.start * d, kvs.stop * d),
             "v_proj.weight": (0, kvs.start * d, kvs.stop * d), "v_proj.bias": (0, kvs.start * d, kvs.stop * d),
             "o_proj.weight": (1, qs.start * d, qs.stop * d),
             "gate_proj.weight": (0, i0, i0 + n_i), "gate_proj.bias": (0, i0, i0 + n_i),
             "up_proj.weight": (0, i0, i0 + n_i), "up_proj.bias": (0, i0, i0 + n_i),
             "down_proj.weight": (1, i0, i0 + n_i),
             "embed_tokens.weight": (0, v0, v0 + n_v), "lm_head.weight": (0, v0, v0 + n_v),
             "lm_head.bias": (0, v0, v0 + n_v)}

    def slicer(name: str):
        return rules.get(".".join(name.split(".")[-2:]))

    return slicer


def heads_of(config) -> tuple[int, int, int]:
    """(attention heads, KV heads, head size) of a config object or ``config.json`` dict."""
    heads = int(_get(config, "num_attention_heads"))
    return (heads, int(_get(config, "num_key_value_heads", None) or heads),
            int(_get(config, "head_dim", None) or _get(config, "hidden_size") // heads))
