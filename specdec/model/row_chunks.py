"""Matrix multiplies of exactly :data:`ROW_CHUNK` rows a call, so a row's result does not depend on its batch (CUDA)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ROW_CHUNK = 128


def in_row_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int = ROW_CHUNK) -> torch.Tensor:
    """``fn`` (row-wise, e.g. a linear) over x [M, K] in calls of exactly ``rows`` rows (zero-padded) -> [M, N]."""
    M = x.shape[0]
    x = x.contiguous()
    if x.data_ptr() % 16:  # an odd view: the kernel choice depends on alignment too
        x = x.clone()
    if M % rows or not M:  # one pad for the last chunk (a single op: the GPU is launch-bound at these sizes)
        x = F.pad(x, (0, 0, 0, rows - M % rows))
    if x.shape[0] == rows:
        return fn(x)[:M]
    return torch.cat([fn(part) for part in x.split(rows)])[:M]
