"""The verifier's own forward for Llama-family decoders (Llama, Mistral without sliding window, Qwen2, Qwen3), over
a packed batch and the KV pool; batch-invariant (docs/engine.md, "Batch invariance: how")."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.errors import UnsupportedModel
from specdec.model import cuda, hugepages
from specdec.model.attention import select_backend, tree_attention
from specdec.model.batch import PackedBatch
from specdec.model.checkpoint import SUPPORTED_ROPE, SUPPORTED_TYPES, unsupported_rope, unsupported_type
from specdec.model.cuda.graphs import LayerGraphs
from specdec.model.cuda.plan import DevicePlan, device_tiles
from specdec.model.glue import make_glue
from specdec.model.kv_pool import KVPool
from specdec.model.linear import Linear
from specdec.model.lora import LoraAdapter, add_lora, row_groups
from specdec.model.native_stack import NativeStack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderSpec:
    """What the forward needs of a model config (validated)."""

    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    rms_eps: float
    qk_norm: bool

    @classmethod
    def from_config(cls, cfg) -> "DecoderSpec":
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED_TYPES:
            raise unsupported_type(mt)
        sw = getattr(cfg, "sliding_window", None)
        if sw is not None and (mt == "mistral" or getattr(cfg, "use_sliding_window", False)):
            raise UnsupportedModel(f"{mt} with a sliding window ({sw}) is not supported: attention over the "
                                   f"whole context would give different outputs")
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            raise UnsupportedModel(f"{mt}: only full-attention layers are supported (layer_types "
                                   f"{sorted(set(cfg.layer_types))})")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"activation {act!r} is not supported (SwiGLU with silu only)")
        rope = getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        if rope_type not in SUPPORTED_ROPE:
            raise unsupported_rope(rope_type)
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if heads % kv:
            raise UnsupportedModel(f"{heads} attention heads are not a multiple of {kv} KV heads")
        return cls(mt, cfg.hidden_size, heads, kv, head_dim, cfg.num_hidden_layers, float(cfg.rms_norm_eps),
                   mt == "qwen3")


@dataclass
class LayerWeights:
    ln1: torch.Tensor  # [D]
    qkv: Linear  # [(Hq + 2 Hkv) * d, D]: Q, K, V in one matrix
    q_norm: torch.Tensor | None  # [d] (Qwen3)
    k_norm: torch.Tensor | None
    o: Linear  # [D, Hq * d]
    ln2: torch.Tensor  # [D]
    gate_up: Linear  # [2 I, D]: gate and up in one matrix
    down: Linear  # [D, I]


def _cat_bias(*linears) -> torch.Tensor | None:
    bs = [lin.bias for lin in linears]
    if all(b is None for b in bs):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype,
                                                                    device=lin.weight.device)
                      for b, lin in zip(bs, linears)])


def _layer_weights(layer) -> LayerWeights:
    a, m = layer.self_attn, layer.mlp
    qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    return LayerWeights(
        layer.input_layernorm.weight.detach(),
        Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
               _cat_bias(a.q_proj, a.k_proj, a.v_proj)),
        qn.weight.detach() if qn is not None else None, kn.weight.detach() if kn is not None else None,
        Linear(a.o_proj.weight.detach(), a.o_proj.bias.detach() if a.o_proj.bias is not None else None),
        layer.post_attention_layernorm.weight.detach(),
        Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), _cat_bias(m.gate_proj, m.up_proj)),
        Linear(m.down_proj.weight.detach(), m.down_proj.bias.detach() if m.down_proj.bias is not None else None))


class DecoderModel:
    """Layers ``[first, last)`` of a Llama-family decoder (+ embedding / final norm + head); ``graphs``: CUDA graphs."""

    def __init__(self, hf_model, first: int = 0, last: int | None = None, compile: bool = False,
                 graphs: bool = True, attention_backend: str = "triton"):
        cfg = hf_model.config
        self.spec = spec = DecoderSpec.from_config(cfg)
        self.config = cfg
        inner = hf_model.model
        self.first, self.last = first, spec.num_layers if last is None else last
        if not 0 <= self.first < self.last <= spec.num_layers:
            raise ValueError(f"layer slice [{first}, {last}) is outside 0..{spec.num_layers}")
        self.is_first, self.is_last = self.first == 0, self.last == spec.num_layers
        self.layers = [_layer_weights(inner.layers[i]) for i in range(self.first, self.last)]
        self.embed = inner.embed_tokens.weight.detach() if self.is_first else None  # [V, D]
        self.norm = inner.norm.weight.detach() if self.is_last else None
        lm_bias = getattr(hf_model.lm_head, "bias", None) if self.is_last else None
        self.lm_head = (Linear(hf_model.lm_head.weight.detach(), lm_bias.detach() if lm_bias is not None else None)
                        if self.is_last else None)  # [V', D]
        p = self.layers[0].qkv.weight
        self.dtype, self.device = p.dtype, p.device
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.detach().float().to(self.device)  # [d / 2]
        self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        # verifier.attention_backend: the kernels where they run, else torch's SDPA (one log line saying why)
        self.kernel, why = select_backend(self.device, self.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                          attention_backend)
        self.attention_backend = attention_backend if why is None else "sdpa"  # what runs
        if why is not None:
            log.warning("tree attention: torch SDPA over the gathered pages in place of the Triton kernel: %s (exact "
                        "outputs; not bit-invariant across batch compositions)", why)
        self.scale = spec.head_dim ** -0.5
        self.glue = make_glue(self.device, self.dtype, compile)
        self._weights_on_huge_pages()
        self.stack = NativeStack(self) if NativeStack.supports(self) else None  # the layers in one native call
        self.graphs = LayerGraphs(self) if graphs and self.kernel and cuda.available(self.device) else None
        self.adapters: dict = {}  # name -> LoraAdapter loaded for the next forward (deploy/verifier/adapters.py)

    def share_weights(self, hf_model) -> None:
        """Point ``hf_model``'s Q/K/V and gate/up weights at views of the fused matrices (frees the copies)."""
        inner = hf_model.model
        for i, w in zip(range(self.first, self.last), self.layers):
            a, m = inner.layers[i].self_attn, inner.layers[i].mlp
            for fused, parts in ((w.qkv.weight, (a.q_proj, a.k_proj, a.v_proj)),
                                 (w.gate_up.weight, (m.gate_proj, m.up_proj))):
                row = 0
                for lin in parts:
                    n = lin.weight.shape[0]
                    lin.weight = torch.nn.Parameter(fused[row:row + n], requires_grad=False)
                    row += n

    def layer_linears(self) -> list[Linear]:
        """Every linear of this stage's layers, in the order a forward runs them."""
        return [f for w in self.layers for f in (w.qkv, w.o, w.gate_up, w.down)]

    def _weights_on_huge_pages(self) -> None:
        """The packed weights of every native linear, in forward order, in one huge-page mapping (one stream)."""
        lins = self.layer_linears() + [self.lm_head]
        lins = [f for f in lins if f is not None and f.lib is not None]
        for f, w in zip(lins, hugepages.arena([f.native_w for f in lins])):
            f.native_w = w

    def warmup(self, row_counts=(1, 2, 17)) -> None:
        """Run the glue on dummy rows of each count (``compile=True``: a graph for 1 row, a dynamic one for more)."""
        s, g = self.spec, self.glue
        for n in row_counts:
            h = torch.zeros(n, s.hidden_size, dtype=self.dtype, device=self.device)
            w = self.layers[0]
            cos, sin = self._rope(torch.arange(n))
            qkv = torch.zeros(n, s.num_heads + 2 * s.num_kv_heads, s.head_dim, dtype=self.dtype, device=self.device)
            g.qk_rope(qkv, cos, sin, s.num_heads, s.num_kv_heads, w.q_norm, w.k_norm, s.rms_eps)
            g.residual_norm(h, h, w.ln2, s.rms_eps)
            g.swiglu(torch.zeros(n, w.gate_up.out_features, dtype=self.dtype, device=self.device))
            g.norm(h, w.ln1, s.rms_eps)

    @property
    def num_local_layers(self) -> int:
        return len(self.layers)

    def new_pool(self, capacity_tokens: int, prefix_caching: bool = False) -> KVPool:
        s = self.spec
        return KVPool(self.num_local_layers, s.num_kv_heads, s.head_dim, capacity_tokens, self.dtype, self.device,
                      prefix_caching)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, d] in the model dtype (as HF: computed in float32, then cast)."""
        freqs = positions.to(self.device).float()[:, None] * self.inv_freq[None, :]  # [N, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return ((emb.cos() * self.rope_scale).to(self.dtype)[:, None, :],
                (emb.sin() * self.rope_scale).to(self.dtype)[:, None, :])

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, pool: KVPool, hidden: torch.Tensor | None = None,
                on_layer=None) -> torch.Tensor:
        """Run this slice's layers; returns hidden states [N, D] (before the final norm). The first slice
        embeds ``batch.input_ids``, later ones take ``hidden`` [N, D]; each layer writes the new K/V into ``pool``.
        ``on_layer(n, h, batch)`` sees h [N, D] after each layer (``n``: layers run so far) and must not change it."""
        N = batch.num_tokens
        # rows per LoRA target version; each adds its own delta to the fused linears (lora.py)
        lora = row_groups(batch.adapter_rows, N, self.adapters, self.device) if batch.adapter_rows else []
        if self.graphs is not None and not lora and on_layer is None:
            h = self.graphs(batch, pool, hidden)
            if h is not None:
                return h
        h = self.embed_rows(batch.input_ids.to(self.device), hidden)
        cos, sin = self._rope(batch.positions)
        where = pool.locate(batch.slots.to(self.device))
        if self.device.type == "cpu":
            plan = batch.plan
        elif self.kernel:  # the CUDA kernel's plan, built once for every layer
            plan = DevicePlan.of(batch.plan, self.device, self.spec.num_heads, self.spec.num_kv_heads,
                                 device_tiles(self.device, self.spec.head_dim).block_m)
        else:
            plan = batch.plan.to(self.device)
        if self.stack is not None and not lora and (on_layer is None or hasattr(on_layer, "layers")):
            return self.stack(h, cos, sin, pool, where, plan, on_layer, batch)
        return self.run_layers(h, cos, sin, pool, where, plan, lora, on_layer, batch)

    def embed_rows(self, input_ids: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """The stream before the first local layer: the first slice embeds ids [N]; later ones take ``hidden``."""
        return F.embedding(input_ids, self.embed) if self.is_first else hidden.to(self.device, self.dtype)

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, where, plan,
                   lora=(), on_layer=None, batch: PackedBatch | None = None) -> torch.Tensor:
        """The layers: h [N, D] -> h [N, D], each writing K/V at ``where`` (page, offset) [N]; CUDA-graph capturable."""
        s, g = self.spec, self.glue
        N = h.shape[0]
        Hq, Hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        x = g.norm(h, self.layers[0].ln1, s.rms_eps)

        def lin(f: Linear, x: torch.Tensor, i: int, name: str) -> torch.Tensor:
            return self.lora_linear(f, x, lora, self.first + i, name) if lora else f(x)

        for i, w in enumerate(self.layers):
            qkv = lin(w.qkv, x, i, "qkv").view(N, Hq + 2 * Hkv, d)
            q = g.rope_write(qkv, cos, sin, Hq, Hkv, w.q_norm, w.k_norm, s.rms_eps, pool, i, where)
            o = tree_attention(q, pool.k[i], pool.v[i], plan, self.scale, self.kernel)  # [N, Hq, d]
            h, x = g.residual_norm(h, lin(w.o, o.reshape(N, Hq * d), i, "o"), w.ln2, s.rms_eps)
            down = lin(w.down, g.swiglu(lin(w.gate_up, x, i, "gate_up")), i, "down")
            if i + 1 < len(self.layers):  # the residual and the next layer's input norm in one step
                h, x = g.residual_norm(h, down, self.layers[i + 1].ln1, s.rms_eps)
            else:
                h = h + down
            if on_layer is not None:
                on_layer(self.first + i + 1, h, batch)
        return h

    def lora_linear(self, f: Linear, x: torch.Tensor, lora, layer: int, name: str) -> torch.Tensor:
        """``f(x)`` [N, out] plus the LoRA deltas of fused matrix ``name`` of global layer ``layer`` on their rows."""
        return add_lora(f(x), x, lora, layer, name)

    def adapter_base(self) -> tuple[DecoderSpec, int]:
        """The spec and intermediate size a LoRA version's tensors are checked against (the whole model's)."""
        return self.spec, self.config.intermediate_size

    def load_adapter(self, name: str, path) -> LoraAdapter:
        """A LoRA target version's factors for this slice's layers, in its dtype, on its device (lora.py)."""
        spec, inter = self.adapter_base()
        return LoraAdapter.load(name, path, spec, inter, self.dtype, self.device, range(self.first, self.last),
                                self.adapter_shard())

    def adapter_shard(self):
        """The slicer LoRA factors are cut with (None: whole; a tensor-parallel rank's: tensor_parallel.py)."""
        return None

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head for the given rows: [R, D] -> [R, V] in the model dtype."""
        return self.lm_head(self.glue.norm(hidden, self.norm, self.spec.rms_eps))
