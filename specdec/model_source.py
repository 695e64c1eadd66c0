"""A model spec's ``config.json`` before any weights load: a local directory, the hub cache for a hub id
(never downloaded), or the built-ins (``tiny-random``, the embedded model). No torch (the router reads it)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_PREFIX = "tiny-random"  # a model spec: a random tiny Llama built in code (tests)
EMBEDDED_ALIASES = {"embedded", "smollm2", "smollm2-135m", "smollm2-135m-instruct"}
# The embedded SmolLM2-135M-Instruct's shapes in tiny_llama_config's terms: a random model of the
# same work per token where the weights cannot come (a GPU box with no network; benchmarks)
EMBEDDED_SHAPES = dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                       intermediate_size=1536, max_position_embeddings=8192)

# transformers' context length per family where config.json leaves it out (configuration_<family>.py)
DEFAULT_CONTEXT = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}


def config_json(spec: str) -> dict | None:
    """The parsed ``config.json`` of a local directory or a cached hub id; None when neither has one."""
    path = Path(spec)
    where = path if (path / "config.json").is_file() else hub_dir(spec)
    return json.loads((where / "config.json").read_text()) if where is not None else None


def hub_dir(spec: str) -> Path | None:
    """The cached snapshot directory of hub id ``spec`` (it holds config.json), or None."""
    path = Path(spec)
    if path.exists() or spec.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec, "config.json")
    except (ImportError, ValueError):
        return None
    return Path(found).parent if isinstance(found, str) else None


def context_length(config: dict) -> int | None:
    """The checkpoint's ``max_position_embeddings`` (its family's default where it is left out)."""
    return config.get("max_position_embeddings") or DEFAULT_CONTEXT.get(config.get("model_type"))


def checkpoint_dtype(config: dict) -> str | None:
    """``torch_dtype`` (transformers 4) or ``dtype`` (5) of a config.json ('bfloat16', ...); None if absent."""
    d = config.get("torch_dtype") or config.get("dtype")
    return str(d).removeprefix("torch.") if d else None


def tiny_config(vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                num_kv_heads: int = 2, intermediate_size: int = 128, max_position_embeddings: int = 4096) -> dict:
    """``config.json`` of a tiny Llama for tests (also what transformers' ``LlamaConfig`` takes)."""
    return dict(model_type="llama", vocab_size=vocab_size, hidden_size=hidden_size,
                intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rms_norm_eps=1e-5)
