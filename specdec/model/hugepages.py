"""CPU tensors backed by transparent huge pages (Linux THP), else ordinary ones (docs/specdec.md; docs/engine.md)."""

from __future__ import annotations

import math
import mmap
import os
from functools import lru_cache
from pathlib import Path

import torch

HUGE = 2 << 20  # bytes per huge page (x86-64, arm64 with 4 KiB base pages)
ALIGN = 64  # bytes: each tensor of an arena starts on a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether madvise'd huge pages can be had here (THP ``always`` or ``madvise``)."""
    if os.environ.get("SPECEDGE_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def _mapping(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], 2 MiB-aligned, in an anonymous mapping advised for huge pages (the tensor holds the mapping)."""
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE
    return raw[start:start + nbytes]


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on huge pages (CPU); an ordinary tensor elsewhere."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or not available() or nbytes < HUGE:
        return torch.empty(shape, dtype=dtype, device=device)
    return _mapping(nbytes).view(dtype).view(shape)


def arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` back to back (cache-line aligned) in one huge-page mapping, else the tensors."""
    if not tensors or not available() or any(t.device.type != "cpu" for t in tensors):
        return list(tensors)
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if total < HUGE:
        return list(tensors)
    buf = _mapping(total)
    out = []
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        c = buf[off:off + n].view(t.dtype).view(t.shape)
        c.copy_(t)
        out.append(c)
    return out
