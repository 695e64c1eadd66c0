"""The verifier's batch-invariant path on CUDA (bf16 / fp16 / fp32).

torch's own CUDA kernels choose their work split by the shape of the whole call (cuBLAS's GEMM
kernel by the row count, SDPA's key split by the batch's longest sequence, reductions by the row
count), so a row's rounding would depend on who shares its batch. This package keeps every row's
arithmetic fixed (docs/engine.md, "Batch invariance: how"):

- tree attention and RMSNorm as Triton kernels (:mod:`.kernels`), each row reduced in a fixed
  order; RoPE with the K/V write, and SwiGLU, as Triton kernels too (fewer launches);
- the linears as GEMMs of a fixed row count (:func:`specdec.model.row_chunks.in_row_chunks`).

Triton ships with PyTorch's CUDA wheels; the CPU install (and CI) never imports it.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels run on ``device`` (a CUDA device, Triton installed)."""
    return torch.device(device).type == "cuda" and _triton_importable()
