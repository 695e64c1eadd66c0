"""The verifier's batch-invariant path on CUDA (bf16 / fp16 / fp32).

On a GPU, torch's own kernels choose their work split by the shape of the whole call: cuBLAS
picks a GEMM kernel (tiles, split-K) by the row count, SDPA splits a row's keys by the
batch's longest sequence, and torch's reductions (RMSNorm's mean) spread a row over more
threads when a batch has few rows. Each choice changes the rounding of every row, so a
session's greedy output in bf16 would depend on who shares its batch. This package keeps
every row's arithmetic fixed (the guarantee of docs/engine.md, "Batch invariance: how"):

- tree attention and RMSNorm as Triton kernels (:mod:`.kernels`): attention reads a session's
  keys once for all its rows and query heads, and reduces each row's logical sequence in blocks
  and chunks at fixed positions; RMSNorm one row per program (RoPE with the K/V write, and
  SwiGLU, are Triton kernels too, for fewer launches);
- the linears as GEMMs of a fixed row count (:func:`specdec.model.row_chunks.in_row_chunks`):
  the same shape, so the same kernel and the same per-row arithmetic whatever the batch.

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
