"""LoRA target versions in the verifier's forward: many adapters, one batch (FlexSpec §III-B/C). A row of
adapter ``i``: ``y = x W^T + scale * (x A_i^T) B_i^T`` (PEFT adapters); batch-invariant in bf16. docs/specdec.md."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import UnsupportedModel
from specdec.model.linear import Linear

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT module name -> (fused matrix of the verifier's forward, part index in it)
FUSED = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
         "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """What of a PEFT ``adapter_config.json`` the forward honours (the rest is refused)."""

    r: int
    scale: float
    target_modules: tuple[str, ...]
    base_model: str | None

    @classmethod
    def read(cls, path: str | Path) -> "AdapterConfig":
        """Validate ``path/adapter_config.json``; raises ``UnsupportedModel`` with the reason."""
        f = Path(path) / CONFIG_FILE
        if not f.is_file():
            raise UnsupportedModel(f"{path}: no {CONFIG_FILE} (a PEFT LoRA adapter directory is expected)")
        if not (Path(path) / WEIGHTS_FILE).is_file():
            raise UnsupportedModel(f"{path}: no {WEIGHTS_FILE}")
        try:
            c = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise UnsupportedModel(f"{path}: {CONFIG_FILE} cannot be read ({e})") from None
        if not isinstance(c, dict):
            raise UnsupportedModel(f"{path}: {CONFIG_FILE} is not a JSON object")
        if c.get("peft_type", "LORA") != "LORA":
            raise UnsupportedModel(f"{path}: peft_type {c.get('peft_type')!r}; only LORA adapters are served")
        refused = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
                   "rank_pattern": {}, "alpha_pattern": {}, "layers_pattern": None, "layer_replication": None}
        for k, ok in refused.items():
            if c.get(k) not in (ok, None) and not (ok == {} and not c.get(k)):
                raise UnsupportedModel(f"{path}: {k}={c.get(k)!r} is not supported (LoRA on linear layers only)")
        targets = c.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else list(targets)
        bad = sorted(set(targets) - set(FUSED))
        if bad or not targets:
            raise UnsupportedModel(f"{path}: target_modules {bad or targets} not supported; LoRA may target "
                                   f"{', '.join(FUSED)}")
        try:
            r = int(c["r"])
        except (KeyError, TypeError, ValueError):
            raise UnsupportedModel(f"{path}: r must be an integer (the LoRA rank)") from None
        if r < 1:
            raise UnsupportedModel(f"{path}: r must be >= 1")
        alpha = float(c.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r
        return cls(r, scale, tuple(sorted(targets, key=list(FUSED).index)), c.get("base_model_name_or_path"))


@dataclass
class LoraPair:
    """One fused matrix's delta: ``x [M, K] -> B(A(x)) [M, N]`` (scale folded into B)."""

    A: object  # Linear [m r, K]
    B: object  # Linear [N, m r]


class LoraAdapter:
    """A loaded adapter: per global layer index, the fused matrices it changes."""

    def __init__(self, name: str, config: AdapterConfig, layers: dict[int, dict[str, LoraPair]], nbytes: int):
        self.name, self.config, self.layers, self.nbytes = name, config, layers, nbytes

    @classmethod
    def load(cls, name: str, path: str | Path, spec, intermediate_size: int, dtype: torch.dtype,
             device: torch.device | str = "cpu", layers: range | None = None, shard=None) -> "LoraAdapter":
        """Read a PEFT adapter for a decoder of ``spec`` (shapes checked); ``layers``: only these (a stage's).
        ``shard``: a tensor-parallel rank's ``slicer`` of the base weights (shard_plan.shard_slicer): each factor
        is cut to match (:func:`shard_factors`); ``spec`` and ``intermediate_size`` stay the whole model's."""
        cfg, mats, out = _read(path, spec, intermediate_size)
        if shard is not None:
            out = shard_factors(mats, out, shard)
        keep = layers if layers is not None else range(spec.num_layers)
        by_layer: dict[int, dict[str, LoraPair]] = {}
        nbytes = 0
        for fused in ("qkv", "o", "gate_up", "down"):
            parts = [m for m in FUSED if FUSED[m][0] == fused]
            offsets = [sum(out[p] for p in parts[:j]) for j in range(len(parts))]
            for li in keep:
                present = [(j, p) for j, p in enumerate(parts) if (li, p) in mats]
                if not present:
                    continue
                r = cfg.r
                A = torch.cat([mats[(li, p)]["A"] for _, p in present])  # [m r, K]
                B = torch.zeros(sum(out[p] for p in parts), r * len(present))  # [N, m r], block-diagonal
                for c, (j, p) in enumerate(present):
                    B[offsets[j]: offsets[j] + out[p], c * r: (c + 1) * r] = mats[(li, p)]["B"] * cfg.scale
                A, B = A.to(device, dtype).contiguous(), B.to(device, dtype).contiguous()
                nbytes += A.numel() * A.element_size() + B.numel() * B.element_size()
                by_layer.setdefault(li, {})[fused] = LoraPair(Linear(A), Linear(B))
        return cls(name, cfg, by_layer, nbytes)


def shard_factors(mats: dict, out: dict[str, int], slicer) -> dict[str, int]:
    """Cut each module's factors (``mats[(layer, module)]``: A [r, K], B [N, r]) in place as the rank's base weight
    W [N, K] is cut by ``slicer``: W's rows (column-parallel: q/k/v, gate/up) -> B's rows, A whole, so the rank's
    delta is its own output rows; W's columns (row-parallel: o, down) -> A's columns, B whole, so the rank's delta
    is a partial sum, added to the base's before its one fixed-order sum. Returns the rank's output sizes."""
    rules = {m: slicer(f"{m}.weight") for m in out}
    for (_, mod), f in mats.items():
        if rules[mod] is None:
            continue
        dim, a, b = rules[mod]
        if dim == 0:
            f["B"] = f["B"][a:b]  # [N_local, r]
        else:
            f["A"] = f["A"][:, a:b]  # [r, K_local]
    return {m: rules[m][2] - rules[m][1] if rules[m] is not None and rules[m][0] == 0 else n for m, n in out.items()}


def check(path: str | Path, spec, intermediate_size: int) -> AdapterConfig:
    """Validate an adapter (config, each tensor's name and shape) for a base of ``spec``; else ``UnsupportedModel``."""
    return _read(path, spec, intermediate_size)[0]


def fingerprint(path: str | Path) -> tuple:
    """An adapter's identity without reading it: size and mtime (ns) of its two files (rewritten in place: new)."""
    out = []
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (Path(path) / f).stat()
            out.append((st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def _read(path: str | Path, spec, intermediate_size: int):
    """The adapter's config, its float32 A/B per (layer, module), and each module's output size."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = AdapterConfig.read(path)
    try:
        raw = load_file(str(Path(path) / WEIGHTS_FILE))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:  # truncated, corrupt, unreadable
        raise UnsupportedModel(f"{path}: {WEIGHTS_FILE} cannot be read ({type(e).__name__}: {e})") from None
    D, d = spec.hidden_size, spec.head_dim
    out = {"q_proj": spec.num_heads * d, "k_proj": spec.num_kv_heads * d, "v_proj": spec.num_kv_heads * d,
           "o_proj": D, "gate_proj": intermediate_size, "up_proj": intermediate_size, "down_proj": D}
    inp = {m: D for m in FUSED} | {"o_proj": spec.num_heads * d, "down_proj": intermediate_size}
    mats: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY.search(key)
        if m is None:
            raise UnsupportedModel(f"{path}: unexpected tensor {key!r} (LoRA A/B of decoder linears only)")
        li, mod, ab = int(m.group(1)), m.group(2), m.group(3)
        if mod not in cfg.target_modules or not 0 <= li < spec.num_layers:
            raise UnsupportedModel(f"{path}: tensor {key!r} is outside the adapter's targets / the model")
        want = (cfg.r, inp[mod]) if ab == "A" else (out[mod], cfg.r)
        if tuple(t.shape) != want:
            raise UnsupportedModel(f"{path}: {key} has shape {tuple(t.shape)}, the base needs {want}")
        mats.setdefault((li, mod), {})[ab] = t.float()
    if any(len(v) != 2 for v in mats.values()):
        raise UnsupportedModel(f"{path}: every LoRA module needs both lora_A and lora_B")
    if not mats:
        raise UnsupportedModel(f"{path}: {WEIGHTS_FILE} holds no LoRA tensors")
    return cfg, mats, out


RowGroups = list[tuple[LoraAdapter, torch.Tensor | None]]  # (adapter, its rows [M_g] long; None = all rows)


def row_groups(adapter_rows: list[tuple[str, torch.Tensor]], num_rows: int, loaded,
               device: torch.device | str = "cpu") -> RowGroups:
    """The batch's rows per adapter (``PackedBatch.adapter_rows``), resolved to ``loaded[name]``, on ``device``."""
    out: RowGroups = []
    for name, rows in adapter_rows:
        out.append((loaded[name], None if rows.numel() == num_rows else rows.to(device)))
    return out


def add_lora(y: torch.Tensor, x: torch.Tensor, groups: RowGroups, layer: int, fused: str) -> torch.Tensor:
    """``y [N, out] += B_i(A_i(x_rows_i))`` per adapter group ``i``, in place (other rows untouched); x: [N, K]."""
    for ad, rows in groups:
        pair = ad.layers.get(layer, {}).get(fused)
        if pair is None:
            continue
        if rows is None:
            y += pair.B(pair.A(x))
        else:
            y.index_add_(0, rows, pair.B(pair.A(x.index_select(0, rows))))
    return y
