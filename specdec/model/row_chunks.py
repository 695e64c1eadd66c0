"""Matrix multiplies of a fixed row count, so a row's result does not depend on its batch (CUDA).

cuBLAS picks its GEMM kernel (tile shape, split-K) from the call's shape, and each kernel
rounds differently; the row count M is part of that shape. Called on exactly
:data:`ROW_CHUNK` rows at a time (the last chunk zero-padded), every call has the same shape
and the same alignment, so it runs the same kernel, whose per-row arithmetic does not depend
on the values of the other rows: a row gets the same bits in any batch. On a GPU a GEMM of
128 rows costs what one of a single row does while the weights stream (tested in
``tests/specdec/model/test_cuda.py``; timed by ``benchmarks/verify_step.py --device cuda``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ROW_CHUNK = 128


def in_row_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int = ROW_CHUNK) -> torch.Tensor:
    """``fn`` (row-wise, e.g. a linear) over x [M, K] in calls of exactly ``rows`` rows -> [M, N].

    The padding rows are zeros (any values would do: no row reads another)."""
    M = x.shape[0]
    x = x.contiguous()
    if x.data_ptr() % 16:  # an odd view: the kernel choice depends on alignment too
        x = x.clone()
    if M % rows or not M:  # one pad for the last chunk (a single op: the GPU is launch-bound at these sizes)
        x = F.pad(x, (0, 0, 0, rows - M % rows))
    if x.shape[0] == rows:
        return fn(x)[:M]
    return torch.cat([fn(part) for part in x.split(rows)])[:M]
