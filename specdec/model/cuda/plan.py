"""What the CUDA tree attention reads, built once per forward (pure torch, no Triton): tiles of up to
:func:`rows_per_tile` rows of one session, each row's logical length (docs/gpu_attention.md, "Shape of the work")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_M = 64  # query heads (rows x GQA group, padded to a power of two) per tile
CHUNK = 256  # keys per split: boundaries at fixed logical positions (a multiple of the page size)


def group_width(heads: int, kv_heads: int) -> int:
    """Query heads of one GQA group, padded to a power of two (the tile's rows are this apart)."""
    group = heads // kv_heads
    return 1 << (group - 1).bit_length()


def rows_per_tile(heads: int, kv_heads: int) -> int:
    """Rows of one session a tile holds (a constant of the model's head layout)."""
    gp = group_width(heads, kv_heads)
    if gp > BLOCK_M:
        raise ValueError(f"GQA groups of {heads // kv_heads} query heads exceed a {BLOCK_M}-head tile")
    return BLOCK_M // gp


def session_tiles(row_seq: torch.Tensor, rows_per: int) -> torch.Tensor:
    """Rows grouped by session into tiles of up to ``rows_per``, in row order within a session:
    row_seq [N] (host) -> [T, rows_per] int32 row indices, -1 where a tile has fewer rows."""
    seq = row_seq.long().cpu()
    N = seq.numel()
    if N == 0:
        return torch.full((0, rows_per), -1, dtype=torch.int32)
    order = torch.argsort(seq, stable=True)  # [N] rows by session
    by_seq = seq[order]
    counts = torch.bincount(by_seq)  # [B] rows per session
    first = torch.cumsum(counts, 0) - counts  # [B] first sorted index of each session
    rank = torch.arange(N) - first[by_seq]  # [N] index within its session
    tiles_of = (counts + rows_per - 1) // rows_per  # [B]
    tile_base = torch.cumsum(tiles_of, 0) - tiles_of
    table = torch.full((int(tiles_of.sum()), rows_per), -1, dtype=torch.int32)
    table[tile_base[by_seq] + rank // rows_per, rank % rows_per] = order.to(torch.int32)
    return table


def logical_lengths(row_len: torch.Tensor, row_bits: torch.Tensor) -> torch.Tensor:
    """Keys each row attends: row_len + popcount(row_bits), on their device: [N] int32."""
    j = torch.arange(64, device=row_bits.device)
    return (row_len.long() + ((row_bits[:, None] >> j) & 1).sum(1)).to(torch.int32)


def num_chunks(max_len: int) -> int:
    return max(1, -(-max_len // CHUNK))


@dataclass
class DevicePlan:
    """The attention plan on the kernel's device (see :class:`specdec.model.attention.AttentionPlan`)."""

    block_table: torch.Tensor  # [B, max_pages] int: pool page of each session's logical page
    row_seq: torch.Tensor  # [N] int: the row's session
    row_len: torch.Tensor  # [N] int: contiguous logical positions [0, row_len) seen by the row
    row_bits: torch.Tensor  # [N] int64: tree positions row_len + j seen by the row (bit j)
    lengths: torch.Tensor  # [N] int32: row_len + popcount(row_bits)
    tiles: torch.Tensor  # [T, rows_per_tile] int32: rows of one session per tile, -1 = none
    chunks: int  # splits of the longest row: the grid's third dimension

    @classmethod
    def of(cls, plan, device, heads: int, kv_heads: int) -> "DevicePlan":
        """From an :class:`~specdec.model.attention.AttentionPlan` (tensors anywhere)."""
        tiles = session_tiles(plan.row_seq, rows_per_tile(heads, kv_heads))
        bits = plan.row_bits.to(device)
        row_len = plan.row_len.to(device)
        return cls(plan.block_table.to(device), plan.row_seq.to(device), row_len, bits,
                   logical_lengths(row_len, bits), tiles.to(device), num_chunks(plan.max_len))
