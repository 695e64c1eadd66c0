"""The linear layer of the decoder: y = x W^T + b, each row independent of how many rows there are."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdec.model import native
from specdec.model.row_chunks import in_row_chunks


def _can_prepack(w: torch.Tensor) -> bool:
    """Whether oneDNN's prepacked bf16 linear runs here (AVX512 or AVX-NE-CONVERT; elsewhere its reorder raises)."""
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and _mkldnn_bf16())


@functools.lru_cache(maxsize=1)
def _mkldnn_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


def _native_linear(w: torch.Tensor):
    """The native bf16 linear kernel if it runs ``w`` here (CPU, bf16, AVX512-BF16 or AVX2 + FMA, K even), else None."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.shape[1] % 2:
        return None
    lib = native.load()
    return lib if lib is not None and lib.linear_bf16_supported() else None


class Linear:
    """y = x W^T + b with rows independent of the row count: x [M, K] -> [M, N]; on the CPU the native kernel,
    oneDNN (a single row as two) or ``F.linear``, on CUDA ``F.linear`` in fixed row chunks (docs/specdec.md)."""

    BLOCK = 64  # output features per packed weight block (NBLK in the source)

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None = None):
        self.weight, self.bias = w, b  # [N, K], [N]
        self.out_features, self.in_features = w.shape
        self.bf16_cpu = w.device.type == "cpu" and w.dtype == torch.bfloat16
        self.lib = _native_linear(w)
        self.packed = None
        if self.lib is not None:
            N, K = w.shape
            blocks = -(-N // self.BLOCK)
            w = w.contiguous()
            self.native_w = torch.empty(blocks * self.BLOCK * K, dtype=torch.bfloat16)  # [blocks, K/2, 64, 2]
            self.lib.linear_bf16_pack(w.data_ptr(), self.native_w.data_ptr(), N, K)
            self.native_b = None
            if b is not None:
                self.native_b = torch.zeros(blocks * self.BLOCK, dtype=torch.float32)  # [N] padded, float32
                self.native_b[:N] = b.float()
        elif _can_prepack(w):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None:
            x = x.contiguous()
            y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
            err = self.lib.linear_bf16(x.data_ptr(), self.native_w.data_ptr(),
                                       self.native_b.data_ptr() if self.native_b is not None else None,
                                       y.data_ptr(), x.shape[0], self.out_features, self.in_features,
                                       torch.get_num_threads())
            if err:
                raise RuntimeError(f"native linear kernel failed ({err})")
            return y
        if self.weight.is_cuda:  # a fixed GEMM shape: rows do not depend on the batch (row_chunks.py)
            return in_row_chunks(lambda part: F.linear(part, self.weight, self.bias), x)
        single = x.shape[0] == 1 and self.bf16_cpu
        if single:
            x = x.expand(2, -1)
        x = x.contiguous()
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y[:1] if single else y
