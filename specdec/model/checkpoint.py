"""A Llama-family target's weights without transformers: ``config.json`` + ``*.safetensors`` (or a tiny random Llama)
read into a parameter-only module tree under the checkpoint's own names (docs/engine.md, docs/specdec.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from specdec.errors import UnsupportedModel
from specdec.model_source import tiny_config

# transformers' defaults per family where config.json leaves a field out (configuration_<family>.py)
_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=None,
               attention_bias=False, mlp_bias=False, initializer_range=0.02, pad_token_id=None)
FAMILY_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048, num_key_value_heads=None, bos_token_id=1, eos_token_id=2),
    "mistral": dict(max_position_embeddings=4096 * 32, num_key_value_heads=8, sliding_window=4096,
                    bos_token_id=1, eos_token_id=2),
    "qwen2": dict(max_position_embeddings=32768, num_key_value_heads=32, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28, bos_token_id=None, eos_token_id=None),
    "qwen3": dict(max_position_embeddings=32768, num_key_value_heads=32, head_dim=128, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28, bos_token_id=None, eos_token_id=None),
}
SUPPORTED_TYPES = tuple(FAMILY_DEFAULTS)
SUPPORTED_ROPE = (None, "default", "linear", "llama3", "yarn")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
DEFAULT_THETA = 10_000.0
SCALED_ROPE = ("llama3", "yarn", "longrope")  # the types that keep the pretraining context length


def unsupported_type(model_type) -> UnsupportedModel:
    return UnsupportedModel(f"model type {model_type!r} is not supported by the verifier's forward "
                            f"(supported: {', '.join(SUPPORTED_TYPES)})")


def unsupported_rope(rope_type) -> UnsupportedModel:
    return UnsupportedModel(f"RoPE scaling {rope_type!r} is not supported (it depends on the sequence length); "
                            f"supported: default, linear, llama3, yarn")


class CheckpointConfig(SimpleNamespace):
    """A decoder's ``config.json`` as attributes, with its family's defaults and derived fields (``head_dim``...)."""

    @classmethod
    def read(cls, path: str | Path) -> "CheckpointConfig":
        p = Path(path) / "config.json"
        if not p.exists():
            raise FileNotFoundError(f"{p} not found: a target directory holds config.json and *.safetensors")
        return cls.from_dict(json.loads(p.read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> "CheckpointConfig":
        mt = raw.get("model_type")
        if mt not in FAMILY_DEFAULTS:
            raise unsupported_type(mt)
        missing = [k for k in REQUIRED if raw.get(k) is None]
        if missing:
            raise UnsupportedModel(f"config.json of a {mt} model lacks {', '.join(missing)}")
        c = {**_COMMON, **FAMILY_DEFAULTS[mt], **raw}
        if c["head_dim"] is None:
            c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
        if c["num_key_value_heads"] is None:
            c["num_key_value_heads"] = c["num_attention_heads"]
        if "use_sliding_window" in c:  # qwen2/qwen3: the window applies only when switched on
            if not c["use_sliding_window"]:
                c["sliding_window"] = None
            if c.get("layer_types") is None:
                c["layer_types"] = ["sliding_attention" if c["sliding_window"] is not None
                                    and i >= c["max_window_layers"] else "full_attention"
                                    for i in range(c["num_hidden_layers"])]
        c["rope_parameters"] = c["rope_scaling"] = _rope_parameters(raw, c)
        return cls(**c)


def _rope_parameters(raw: dict, c: dict) -> dict:
    """One dict of RoPE parameters, as transformers 5 standardises them (which source wins: docs/specdec.md)."""
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_THETA))
    if raw.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in SCALED_ROPE:
        if "original_max_position_embeddings" in raw:
            rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
    return rope


def rope_frequencies(config: CheckpointConfig) -> tuple[torch.Tensor, float]:
    """inv_freq [d / 2] (float32) and the factor cos/sin are scaled by (YaRN's attention factor, else 1).
    RoPE (Su et al. 2021): default, linear (Chen et al. 2023), llama3, yarn (Peng et al. 2023, eqs. 17-22), as
    transformers computes them (docs/specdec.md); others are refused by :class:`specdec.model.decoder.DecoderSpec`."""
    rope = config.rope_parameters
    kind, base = rope["rope_type"], rope["rope_theta"]
    if kind == "default":  # Llama's own default ignores partial_rotary_factor (modeling_llama)
        d = config.head_dim
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
    d = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
    if kind == "yarn":
        return _yarn(rope, base, d, config.max_position_embeddings)
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "llama3":
        factor, original = rope["factor"], rope["original_max_position_embeddings"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, blended, scaled), 1.0
    raise unsupported_rope(kind)


def _yarn(rope: dict, base: float, d: int, max_positions: int) -> tuple[torch.Tensor, float]:
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = dim_of(rope.get("beta_fast") or 32), dim_of(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    pos_freqs = base ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp  # 1: the original frequency (high-frequency dims), 0: interpolated
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, attention


# -- the module tree ------------------------------------------------------------------
class Norm(nn.Module):
    """An RMSNorm's weight [n]."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))


class Attention(nn.Module):
    def __init__(self, c: CheckpointConfig):
        super().__init__()
        D, Hq, Hkv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv_bias = c.model_type == "qwen2" or c.attention_bias  # Qwen2 always has Q/K/V biases
        self.q_proj = nn.Linear(D, Hq * d, bias=qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * d, bias=qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * d, bias=qkv_bias)
        self.o_proj = nn.Linear(Hq * d, D, bias=c.attention_bias and c.model_type != "qwen2")
        if c.model_type == "qwen3":
            self.q_norm, self.k_norm = Norm(d), Norm(d)


class MLP(nn.Module):
    def __init__(self, c: CheckpointConfig):
        super().__init__()
        D, inter, bias = c.hidden_size, c.intermediate_size, c.mlp_bias
        self.gate_proj = nn.Linear(D, inter, bias=bias)
        self.up_proj = nn.Linear(D, inter, bias=bias)
        self.down_proj = nn.Linear(inter, D, bias=bias)


class Layer(nn.Module):
    def __init__(self, c: CheckpointConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm, self.post_attention_layernorm = Norm(c.hidden_size), Norm(c.hidden_size)


class Rotary(nn.Module):
    """RoPE's ``inv_freq`` [d / 2] (float32) and ``attention_scaling``, as transformers names them."""

    def __init__(self, c: CheckpointConfig, device: torch.device | str = "cpu"):
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(c)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)


def _embedding(n: int, dim: int) -> nn.Embedding:
    """nn.Embedding [n, dim], built on the meta device without its random init (why: docs/specdec.md)."""
    w = torch.empty(n, dim)
    return nn.Embedding(n, dim, _weight=w) if w.is_meta else nn.Embedding(n, dim)


class Decoder(nn.Module):
    def __init__(self, c: CheckpointConfig):
        super().__init__()
        self.embed_tokens = _embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = Norm(c.hidden_size)


class CausalLMWeights(nn.Module):
    """A decoder-only LM's parameters under the checkpoint's names, its config and ``generation_config`` (or None)."""

    def __init__(self, config: CheckpointConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.generation_config: SimpleNamespace | None = None


def prune(model: nn.Module, first: int, last: int, keep_head: bool = False) -> None:
    """Replace what a stage of layers ``[first, last)`` does not own by placeholders (``keep_head``: keep the head)."""
    inner = model.model
    n = len(inner.layers)
    for i in range(n):
        if not first <= i < last:
            inner.layers[i] = nn.Identity()
    if first != 0:
        inner.embed_tokens = nn.Identity()
    if last != n and not keep_head:
        inner.norm = nn.Identity()
        model.lm_head = nn.Identity()


def read_weights(path: str | Path, dtype: torch.dtype, device: str = "cpu", first: int = 0,
                 last: int | None = None, keep_head: bool = False,
                 shard: tuple[int, int] | None = None) -> CausalLMWeights:
    """The checkpoint in ``path`` with only layers ``[first, last)`` read and materialised (+ the embedding in the
    first stage, final norm and LM head in the last or with ``keep_head``); floating tensors cast to ``dtype``.
    ``shard`` ``(rank, tp)``: only that tensor-parallel rank's part of each tensor is read (its config is the
    rank's, ``config.full_config`` the whole: specdec/model/tensor_parallel.py)."""
    path = Path(path)
    config = CheckpointConfig.read(path)
    slicer = None
    if shard is not None:
        from specdec.model.shard_plan import local_config, shard_slicer

        slicer = shard_slicer(config, *shard)
        config = local_config(config, *shard)
    n = config.num_hidden_layers
    last = n if last is None else last
    head = last == n or keep_head
    tied = bool(config.tie_word_embeddings)

    def wanted(key: str) -> bool:
        if key.startswith("model.layers."):
            return first <= int(key.split(".")[2]) < last
        if key.startswith("model.embed_tokens."):
            return first == 0 or (head and tied)
        return head and (key.startswith("model.norm.") or key.startswith("lm_head."))

    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                name = key if key.startswith(("model.", "lm_head.")) else "model." + key  # a base-model file
                if wanted(name):
                    part = slicer(name) if slicer is not None else None
                    if part is None:
                        t = fh.get_tensor(key)
                    else:  # this rank's rows or columns only
                        dim, a, b = part
                        t = fh.get_slice(key)[(slice(None),) * dim + (slice(a, b),)]
                    state[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    if head and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied head
    if first != 0:
        state.pop("model.embed_tokens.weight", None)
    with torch.device("meta"):
        model = CausalLMWeights(config)
    model.load_state_dict(state, strict=False, assign=True)
    prune(model, first, last, keep_head)
    absent = [name for name, p in model.named_parameters() if p.is_meta]
    if absent:
        raise UnsupportedModel(f"checkpoint {path} lacks tensors for layers [{first}, {last}): {absent[:5]}")
    model.model.rotary_emb = Rotary(config, device)
    gen = path / "generation_config.json"
    if gen.exists():
        model.generation_config = SimpleNamespace(eos_token_id=json.loads(gen.read_text()).get("eos_token_id"))
    return model.eval()


def tiny_weights(seed: int = 0, dtype: torch.dtype = torch.float32, **cfg) -> CausalLMWeights:
    """A random tiny Llama with ``torch.manual_seed(seed); LlamaForCausalLM(config)``'s weights (docs/specdec.md)."""
    config = CheckpointConfig.from_dict(tiny_config(**cfg))
    with torch.device("meta"):
        model = CausalLMWeights(config)
    torch.manual_seed(seed)
    model.model = _drawn(Decoder(config), config)
    model.lm_head = _drawn(nn.Linear(config.hidden_size, config.vocab_size, bias=False), config)
    model.model.rotary_emb = Rotary(config)
    model.generation_config = SimpleNamespace(eos_token_id=config.eos_token_id)
    return model.to(dtype).eval()


@torch.no_grad()
def _drawn(module: nn.Module, config: CheckpointConfig) -> nn.Module:
    """transformers' ``_init_weights`` over ``module``, children before parents."""
    for child in module.children():
        _drawn(child, config)
    if isinstance(module, nn.Linear):
        module.weight.normal_(0.0, config.initializer_range)
        if module.bias is not None:
            module.bias.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.normal_(0.0, config.initializer_range)
        if config.pad_token_id is not None:
            module.weight[config.pad_token_id].zero_()
    elif isinstance(module, Norm):
        module.weight.fill_(1.0)
    return module
