"""specdec/model/cuda/plan.py: rows grouped into per-session tiles, logical lengths from the tree
bits, tile geometry from the head layout (pure torch, any machine)."""

from __future__ import annotations

import pytest
import torch

from specdec.model.attention import AttentionPlan
from specdec.model.batch import ancestor_bits, signed64
from specdec.model.cuda.plan import BLOCK_M, CHUNK, DevicePlan, logical_lengths, num_chunks, rows_per_tile, session_tiles


def test_tiles_hold_one_sessions_rows_in_row_order():
    row_seq = torch.tensor([2, 0, 2, 1, 0, 2, 2, 2])
    tiles = session_tiles(row_seq, 2)
    assert tiles.tolist() == [[1, 4], [3, -1], [0, 2], [5, 6], [7, -1]]
    assert session_tiles(torch.tensor([], dtype=torch.long), 4).shape == (0, 4)


def test_every_row_is_in_exactly_one_tile_of_its_session():
    g = torch.Generator().manual_seed(0)
    row_seq = torch.randint(0, 7, (300,), generator=g)
    tiles = session_tiles(row_seq, 16)
    rows = tiles[tiles >= 0]
    assert sorted(rows.tolist()) == list(range(300))
    for t in tiles:
        real = t[t >= 0]
        assert len(set(row_seq[real].tolist())) == 1 and real.tolist() == sorted(real.tolist())


def test_logical_length_counts_the_tree_bits():
    bits = [signed64(b) for b in ancestor_bits([-1, 0, 1] + list(range(2, 62)))]  # a 63-deep chain; the top bit set
    row_len = torch.full((len(bits),), 100, dtype=torch.int32)
    assert logical_lengths(row_len, torch.tensor(bits)).tolist() == [100 + j + 1 for j in range(len(bits))]


def test_tile_geometry_follows_the_head_layout():
    assert [rows_per_tile(h, 8) for h in (8, 16, 32, 40, 64)] == [BLOCK_M, BLOCK_M // 2, BLOCK_M // 4, BLOCK_M // 8,
                                                                 BLOCK_M // 8]
    with pytest.raises(ValueError, match="GQA groups"):
        rows_per_tile(BLOCK_M * 2, 1)
    assert [num_chunks(n) for n in (1, CHUNK, CHUNK + 1)] == [1, 1, 2]


def test_a_device_plan_keeps_the_rows_and_adds_lengths_and_tiles():
    plan = AttentionPlan(torch.zeros(2, 3, dtype=torch.int32), torch.tensor([1, 0, 1], dtype=torch.int32),
                         torch.tensor([5, 7, 5], dtype=torch.int32), torch.tensor([0, 0, 3]), 7)
    dp = DevicePlan.of(plan, "cpu", 32, 8)
    assert dp.lengths.tolist() == [5, 7, 7] and dp.tiles.tolist() == [[1] + [-1] * 15, [0, 2] + [-1] * 14]
    assert dp.chunks == 1


def test_tiles_are_chosen_per_card_class_and_head_dim_never_per_batch():
    from specdec.model.cuda.plan import CARD_CLASSES, Tiles, card_tiles, device_tiles

    for cc in [(8, 0), (8, 6), (8, 7), (8, 9), (12, 0)]:  # mma.sync: a 64-head tile spills at head dim 128
        assert card_tiles(cc, 128) == Tiles(block_m=32) and card_tiles(cc, 64) == Tiles()
    assert card_tiles((9, 0), 128) == card_tiles((9, 0), 64) == Tiles()
    assert card_tiles((10, 0), 64) == Tiles(maxnreg=255)
    assert device_tiles("cpu", 128) == card_tiles(None, 128) == Tiles()  # the interpreter: as sm_90
    assert set(CARD_CLASSES.values()) == {"sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_120"}
    assert rows_per_tile(32, 8, 32) == 8 and rows_per_tile(9, 3, 64) == 16
