"""What the CUDA tree attention reads, built once per forward (pure torch, no Triton): tiles of up to
:func:`rows_per_tile` rows of one session, each row's logical length (docs/gpu_attention.md, "Shape of the work")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK_M = 64  # query heads (rows x GQA group, padded to a power of two) per tile (card_tiles: 32 on some cards)
CHUNK = 256  # keys per split: boundaries at fixed logical positions (a multiple of the page size)

# The card classes the kernel is compiled for in `make test` (tests/specdec/model/test_cuda_compile.py): A100 (8.0),
# RTX 30xx / A10 / A40 (8.6), Jetson Orin (8.7), L4 / RTX 4090 / L40S (8.9), H100 / H200 (9.0), B200 (10.0),
# RTX 50xx (12.0). Another card runs the verifier's SDPA fallback (specdec/model/attention.py, attention_backend).
CARD_CLASSES = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 7): "sm_87", (8, 9): "sm_89", (9, 0): "sm_90",
                (10, 0): "sm_100", (12, 0): "sm_120"}


@dataclass(frozen=True)
class Tiles:
    """The attention tile's constants on a card class: fixed per card and head dim, never per batch (the order of
    a row's sums depends on them; docs/gpu_attention.md, "Card classes")."""

    block_m: int = BLOCK_M  # query heads per tile
    warps: int = 8
    maxnreg: int | None = None  # ptxas's register cap per thread (None: its own choice)


def card_tiles(capability: tuple[int, int] | None, head_dim: int) -> Tiles:
    """The tile for a card (compute capability; None: the interpreter, as sm_90) and head dim. sm_8x and sm_12x
    multiply on mma.sync, whose operands live in registers: a 64-head tile at head dim 128 spills there (80 bytes on
    sm_80), a 32-head one does not. sm_100's ptxas settles at 128 registers and spills at head dim 64 unless let
    use all 255 a thread of 8 warps may have."""
    major = capability[0] if capability is not None else 9
    if major in (8, 12) and head_dim > 64:
        return Tiles(block_m=32)
    if major == 10:
        return Tiles(maxnreg=255)
    return Tiles()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device) -> tuple[int, int] | None:
    """A CUDA device's compute capability; None for any other device (the interpreter's CPU tensors)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def device_tiles(device, head_dim: int) -> Tiles:
    return card_tiles(device_capability(device), head_dim)


def group_width(heads: int, kv_heads: int) -> int:
    """Query heads of one GQA group, padded to a power of two (the tile's rows are this apart)."""
    group = heads // kv_heads
    return 1 << (group - 1).bit_length()


def rows_per_tile(heads: int, kv_heads: int, block_m: int = BLOCK_M) -> int:
    """Rows of one session a tile holds (a constant of the model's head layout and the card class)."""
    gp = group_width(heads, kv_heads)
    if gp > block_m:
        raise ValueError(f"GQA groups of {heads // kv_heads} query heads exceed a {block_m}-head tile")
    return block_m // gp


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
    def of(cls, plan, device, heads: int, kv_heads: int, block_m: int = BLOCK_M) -> "DevicePlan":
        """From an :class:`~specdec.model.attention.AttentionPlan` (tensors anywhere); ``block_m``: the card's
        (:func:`device_tiles`)."""
        tiles = session_tiles(plan.row_seq, rows_per_tile(heads, kv_heads, block_m))
        bits = plan.row_bits.to(device)
        row_len = plan.row_len.to(device)
        return cls(plan.block_table.to(device), plan.row_seq.to(device), row_len, bits,
                   logical_lengths(row_len, bits), tiles.to(device), num_chunks(plan.max_len))
