"""Huge-page tensors (specdec/model/hugepages.py): same values, 2 MiB-aligned, in huge pages
where THP allows; ordinary tensors where it does not."""

from __future__ import annotations

import pytest
import torch

from specdec.model import hugepages
from specdec.model.kv_pool import KVPool

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages here")


def _anon_huge_kb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@needs_thp
def test_empty_is_aligned_and_faults_in_huge_pages():
    before = _anon_huge_kb()
    t = hugepages.empty((8, 1 << 20), torch.bfloat16)  # 16 MiB
    assert t.shape == (8, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE == 0
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * t.numel()
    assert _anon_huge_kb() - before >= 8 * 1024  # at least half of it in 2 MiB pages


@needs_thp
def test_arena_copies_in_order_cache_line_aligned():
    ts = [torch.randn(1000, 577, dtype=torch.bfloat16), torch.randn(3, dtype=torch.float32),
          torch.randint(0, 9, (2048, 512), dtype=torch.int32)]
    out = hugepages.arena(ts)
    for a, b in zip(ts, out):
        assert torch.equal(a, b) and b.dtype == a.dtype and b.shape == a.shape
        assert b.data_ptr() % hugepages.ALIGN == 0 and b.data_ptr() != a.data_ptr()
    assert out[0].data_ptr() < out[1].data_ptr() < out[2].data_ptr()


def test_small_or_disabled_falls_back(monkeypatch):
    small = hugepages.empty((4, 4), torch.float32)
    assert small.shape == (4, 4)
    ts = [torch.ones(10)]
    assert hugepages.arena(ts)[0] is ts[0]  # under 2 MiB: the tensor itself
    monkeypatch.setenv("SPECEDGE_HUGEPAGES", "0")
    hugepages.available.cache_clear()
    try:
        assert not hugepages.available()
        big = [torch.ones(1 << 21)]
        assert hugepages.arena(big)[0] is big[0]
        assert hugepages.empty((1 << 21,), torch.float32).shape == (1 << 21,)
    finally:
        monkeypatch.delenv("SPECEDGE_HUGEPAGES")
        hugepages.available.cache_clear()


@needs_thp
def test_kv_pool_lives_in_huge_pages():
    pool = KVPool(num_layers=4, kv_heads=3, head_dim=64, capacity_tokens=4096, dtype=torch.bfloat16)
    assert pool.k.data_ptr() % hugepages.HUGE == 0 and pool.v.data_ptr() % hugepages.HUGE == 0
