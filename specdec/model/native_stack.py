"""A stage's decoder layers as one native call (``csrc/decoder.c``), bit for bit the per-op path; CPU bf16, no LoRA or
Qwen3 q/k norms. Why: docs/engine.md, "The layer stack in one native call"; docs/specdec.md."""

from __future__ import annotations

import ctypes

import torch

from specdec.model import native
from specdec.model.glue import NativeGlue


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _layer_row(w) -> list[int]:
    """One layer's addresses, in csrc/decoder.c's LW_ order (a bias may be 0: none)."""
    return [_ptr(w.ln1), _ptr(w.qkv.native_w), _ptr(w.qkv.native_b), _ptr(w.o.native_w), _ptr(w.o.native_b),
            _ptr(w.ln2), _ptr(w.gate_up.native_w), _ptr(w.gate_up.native_b), _ptr(w.down.native_w),
            _ptr(w.down.native_b)]


class NativeStack:
    """Layers ``model.layers`` of a :class:`~specdec.model.decoder.DecoderModel` in one call."""

    def __init__(self, model):
        self.lib = native.load()
        self.model = model
        self.table = torch.tensor([_layer_row(w) for w in model.layers], dtype=torch.int64)  # [L, 10]

    @staticmethod
    def supports(model) -> bool:
        """Whether every layer of ``model`` runs on the native kernels the stack calls."""
        s = model.spec
        return (native.load() is not None and model.device.type == "cpu" and model.dtype == torch.bfloat16
                and model.kernel and isinstance(model.glue, NativeGlue) and not s.qk_norm
                and all(f.lib is not None for f in model.layer_linears())
                and all(t.is_contiguous() for w in model.layers for t in (w.ln1, w.ln2)))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool, where, plan,
                 on_layer=None, batch=None) -> torch.Tensor:
        """h [N, D] (before the first layer) -> h [N, D] after the last, writing each layer's K/V at ``where``
        (page, offset) [N]; ``on_layer(n, h, batch)`` runs after each layer in its ``layers``, as in the forward."""
        m, s = self.model, self.model.spec
        h = h.contiguous().clone()
        cos, sin = cos.contiguous(), sin.contiguous()
        page, off = (t.contiguous() for t in where)
        bt = plan.block_table
        k, v = pool.k, pool.v  # [L, pages, Hkv, d, PS], [L, pages, Hkv, PS, d]
        assert k.stride(0) == v.stride(0) and k.is_contiguous() and v.is_contiguous()
        N, D = h.shape
        L = len(m.layers)
        stops = sorted({n - m.first for n in getattr(on_layer, "layers", ()) if 0 < n - m.first < L}) + [L]
        a = 0
        for b in stops:
            err = self.lib.decoder_layers_bf16(
                self.table[a].data_ptr(), b - a, h.data_ptr(), N, D, s.num_heads, s.num_kv_heads, s.head_dim,
                m.layers[0].down.in_features, ctypes.c_float(s.rms_eps), ctypes.c_float(m.scale), cos.data_ptr(),
                sin.data_ptr(), k[a].data_ptr(), v[a].data_ptr(), k.stride(0), page.data_ptr(), off.data_ptr(),
                bt.data_ptr(), bt.shape[1], plan.row_seq.data_ptr(), plan.row_len.data_ptr(), plan.row_bits.data_ptr(),
                plan.max_len, torch.get_num_threads())
            if err == 3:
                raise MemoryError("native decoder stack: scratch allocation failed")
            if err:
                raise RuntimeError(f"native decoder stack failed ({err})")
            if on_layer is not None:
                on_layer(m.first + b, h, batch)
            a = b
        return h
