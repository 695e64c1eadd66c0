"""The verifier's batch-invariant path on CUDA (bf16 / fp16 / fp32): Triton kernels (:mod:`.kernels`), fixed-row
GEMMs (:mod:`specdec.model.row_chunks`); why: docs/specdec.md. Never imported by the CPU install (no Triton)."""

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
