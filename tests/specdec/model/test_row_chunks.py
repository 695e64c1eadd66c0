"""Fixed-row GEMM calls (the CUDA linears' batch invariance): every call sees exactly the
chunk's row count, the padding never reaches the output, and the result is fn over all rows."""

from __future__ import annotations

import pytest
import torch

from specdec.model.row_chunks import in_row_chunks


@pytest.mark.parametrize("M", [0, 1, 7, 8, 9, 16, 17, 40])
def test_every_call_has_the_chunk_shape_and_the_rows_come_back_in_order(M):
    w = torch.randn(12, 6)
    x = torch.randn(M, 6)
    seen = []

    def fn(part):
        seen.append(tuple(part.shape))
        return part @ w.t()

    y = in_row_chunks(fn, x, rows=8)
    assert y.shape == (M, 12)
    assert torch.allclose(y, x @ w.t(), atol=1e-6)
    assert set(seen) == {(8, 6)} and len(seen) == max(1, -(-M // 8))


def test_an_unaligned_view_is_copied_before_the_call():
    x = torch.randn(9, 6)[1:]  # 24 bytes past an aligned start
    assert x.data_ptr() % 16
    ptrs = []
    in_row_chunks(lambda part: ptrs.append(part.data_ptr()) or part, x, rows=8)
    assert ptrs[0] % 16 == 0
