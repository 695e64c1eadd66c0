"""The elementwise glue of a decoder layer, between its matrix multiplies and attention: RMSNorm, RoPE (+ the
K/V write), SwiGLU, in torch, Triton (:class:`CudaGlue`) or C (:class:`NativeGlue`) as :func:`make_glue` picks."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from specdec.model import cuda, native


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, scale in the model dtype. x: [..., D]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


def qk_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
            q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float):
    """qkv [N, Hq + 2 Hkv, d] -> q [N, Hq, d], k [N, Hkv, d] (normed if Qwen3, rotated), v."""
    q, k, v = qkv[:, :hq], qkv[:, hq: hq + hkv], qkv[:, hq + hkv:]
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def residual_norm(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta)): [N, D] each."""
    h = h + delta
    return h, rms_norm(h, w, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2 I] -> silu(gate) * up [N, I]."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


class Glue:
    """The glue in torch, eager or compiled (``torch.compile``, dynamic shapes)."""

    def __init__(self, compile: bool = False):
        wrap = (lambda f: torch.compile(f, dynamic=True)) if compile else (lambda f: f)
        self._norm, self._qk_rope = wrap(rms_norm), wrap(qk_rope)
        self._residual_norm, self._swiglu = wrap(residual_norm), wrap(swiglu)

    def norm(self, h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(h) * w: [N, D]."""
        return self._norm(h, w, eps)

    def residual_norm(self, h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float):
        """(h + delta, rms_norm(h + delta) * w): [N, D] each."""
        return self._residual_norm(h, delta, w, eps)

    def qk_rope(self, qkv, cos, sin, hq, hkv, q_norm, k_norm, eps):
        """See :func:`qk_rope`."""
        return self._qk_rope(qkv, cos, sin, hq, hkv, q_norm, k_norm, eps)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2 I] -> silu(gate) * up [N, I]."""
        return self._swiglu(gate_up)

    def rope_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   pool, layer: int, where: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on qkv [N, Hq + 2 Hkv, d], k and v written to ``layer`` at ``where`` (page, offset); -> q [N, Hq, d]."""
        q, k, v = self.qk_rope(qkv, cos, sin, hq, hkv, q_norm, k_norm, eps)
        pool.write(layer, where, k, v)
        return q


class NativeGlue(Glue):
    """The glue as one C call per function (CPU, bf16); Qwen3's per-head q/k norms keep the torch RoPE path."""

    def __init__(self):
        super().__init__(compile=False)
        self.lib = native.load()
        if self.lib is None:
            raise RuntimeError("the native kernels are not built here")

    def norm(self, h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        h = h.contiguous()
        x = torch.empty_like(h)
        self.lib.glue_add_rms_norm_bf16(h.data_ptr(), None, None, w.data_ptr(), x.data_ptr(), h.shape[0],
                                        h.shape[1], ctypes.c_float(eps), torch.get_num_threads())
        return x

    def residual_norm(self, h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float):
        h, delta = h.contiguous(), delta.contiguous()
        h_out, x = torch.empty_like(h), torch.empty_like(h)
        self.lib.glue_add_rms_norm_bf16(h.data_ptr(), delta.data_ptr(), h_out.data_ptr(), w.data_ptr(),
                                        x.data_ptr(), h.shape[0], h.shape[1], ctypes.c_float(eps),
                                        torch.get_num_threads())
        return h_out, x

    def rope_write(self, qkv, cos, sin, hq, hkv, q_norm, k_norm, eps, pool, layer, where):
        if q_norm is not None:
            return super().rope_write(qkv, cos, sin, hq, hkv, q_norm, k_norm, eps, pool, layer, where)
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        page, off = where
        N, _, d = qkv.shape
        q = torch.empty(N, hq, d, dtype=qkv.dtype, device=qkv.device)
        k_pages, v_pages = pool.k[layer], pool.v[layer]
        self.lib.glue_rope_kv_bf16(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                                   k_pages.data_ptr(), v_pages.data_ptr(), page.data_ptr(), off.data_ptr(),
                                   N, hq, hkv, d, torch.get_num_threads())
        return q

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        N, two_i = gate_up.shape
        out = torch.empty(N, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
        self.lib.glue_swiglu_bf16(gate_up.data_ptr(), out.data_ptr(), N, two_i // 2, torch.get_num_threads())
        return out


class CudaGlue(Glue):
    """On CUDA: RMSNorm, RoPE with the K/V write and SwiGLU as Triton kernels, one program per row (docs/specdec.md)."""

    def __init__(self, compile: bool = False):
        super().__init__(compile)
        from specdec.model.cuda import kernels

        self.kernels = kernels

    def norm(self, h, w, eps):
        return self.kernels.add_rms_norm(h, None, w, eps)[1]

    def residual_norm(self, h, delta, w, eps):
        return self.kernels.add_rms_norm(h, delta, w, eps)

    def rope_write(self, qkv, cos, sin, hq, hkv, q_norm, k_norm, eps, pool, layer, where):
        if q_norm is not None:
            return super().rope_write(qkv, cos, sin, hq, hkv, q_norm, k_norm, eps, pool, layer, where)
        return self.kernels.rope_write(qkv, cos, sin, hq, hkv, pool.k[layer], pool.v[layer], *where)

    def swiglu(self, gate_up):
        return self.kernels.swiglu(gate_up)

    def qk_rope(self, qkv, cos, sin, hq, hkv, q_norm, k_norm, eps):
        if q_norm is None:
            return super().qk_rope(qkv, cos, sin, hq, hkv, q_norm, k_norm, eps)
        N, _, d = qkv.shape
        q = self.norm(qkv[:, :hq].reshape(N * hq, d), q_norm, eps).view(N, hq, d)
        k = self.norm(qkv[:, hq: hq + hkv].reshape(N * hkv, d), k_norm, eps).view(N, hkv, d)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), qkv[:, hq + hkv:]


def use_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`NativeGlue` runs this: CPU, bf16, the library built here."""
    return device.type == "cpu" and dtype == torch.bfloat16 and native.load() is not None


def make_glue(device: torch.device, dtype: torch.dtype, compile: bool = False) -> Glue:
    """Triton kernels on CUDA; native on CPU in bf16 (unless ``compile``); else torch."""
    if cuda.available(device):
        return CudaGlue(compile)
    return NativeGlue() if not compile and use_native(device, dtype) else Glue(compile)
