"""A model spec's ``config.json`` before any weights load: from a local directory, or from the
Hugging Face hub cache for a hub id (never downloaded). No torch: config validation reads it."""

from __future__ import annotations

import json
from pathlib import Path

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
