"""Packing a forward: every session's new tokens on one flat token axis, no padding.
A row attends ``[0, row_len)`` and ``row_len + j`` per set bit ``j`` of ``row_bits``; a tree node ``j`` (depth ``d_j``)
has RoPE position ``L + d_j``, is written at ``L + 1 + j`` and sees ``[0, L]``, its ancestors and itself. Pure torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.model.attention import AttentionPlan
from specdec.model.kv_pool import KVPool
from specdec.model.native import PAGE_SIZE

MAX_TREE_BITS = 64  # one int64 of ancestor bits per row


@dataclass
class SeqInput:
    sid: str
    tokens: list[int]  # [t]
    positions: list[int]  # [t] RoPE positions
    write_at: list[int]  # [t] logical KV positions the new entries are written to
    row_len: list[int]  # [t] contiguous logical positions each row sees
    row_bits: list[int]  # [t] tree positions row_len + j each row sees (bit j)
    logit_rows: list[int]  # rows whose logits are wanted
    adapter: str | None = None  # the session's target version (LoRA adapter, specdec/model/lora.py); None: base


def chunk_input(sid: str, start: int, tokens: list[int], logit_rows: list[int] | None = None) -> SeqInput:
    """Consecutive tokens at logical positions ``start, start + 1, ...`` (causal)."""
    t = len(tokens)
    pos = list(range(start, start + t))
    return SeqInput(sid, list(tokens), pos, pos, [p + 1 for p in pos], [0] * t,
                    [t - 1] if logit_rows is None else logit_rows)


def ancestor_bits(parents) -> list[int]:
    """bits[j]: node j and its ancestors (node indices; parents[j] < j, -1 = the root)."""
    bits: list[int] = []
    for j, p in enumerate(parents):
        if j >= MAX_TREE_BITS:
            raise ValueError(f"trees are limited to {MAX_TREE_BITS} nodes per forward")
        bits.append((bits[p] if p >= 0 else 0) | (1 << j))
    return bits


def tree_input(sid: str, start: int, root: int, tokens, parents, depths) -> SeqInput:
    """The root at ``start`` and tree nodes behind it (rows: root, then node 0..n-1)."""
    n = len(tokens)
    bits = ancestor_bits(parents)
    return SeqInput(sid, [int(root), *tokens], [start] + [start + d for d in depths],
                    [start] + [start + 1 + j for j in range(n)], [start + 1] * (n + 1),
                    [0] + [signed64(b) for b in bits], list(range(n + 1)))


def signed64(b: int) -> int:
    """An unsigned 64-bit mask as the int64 torch stores."""
    return b - (1 << 64) if b >= 1 << 63 else b


@dataclass
class PackedBatch:
    items: list[SeqInput]
    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slots: torch.Tensor  # [N] long: pool slot (page * PS + offset) of each new entry
    plan: AttentionPlan
    offsets: list[int]  # first row of each item
    logit_index: torch.Tensor  # [R] long: flat rows whose logits are wanted, item by item
    adapter_rows: list[tuple[str, torch.Tensor]] = ()  # (adapter name, its rows [M_g] long), no-adapter rows absent

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def split_logits(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """[R, V] -> one [len(logit_rows), V] per item."""
        return list(torch.split(logits, [len(it.logit_rows) for it in self.items]))


def pack(items: list[SeqInput], pool: KVPool) -> PackedBatch:
    """Flat inputs for ``items``; the pool must already hold pages for every ``write_at``."""
    sids = [it.sid for it in items]
    if len(set(sids)) != len(sids):
        raise ValueError("a session appears twice in one forward")
    offsets, flat_rows, seq = [], [], []
    n = 0
    for b, it in enumerate(items):
        offsets.append(n)
        flat_rows += [n + r for r in it.logit_rows]
        seq += [b] * len(it.tokens)
        n += len(it.tokens)
    block_table = pool.block_table(sids)  # [B, max_pages]
    row_seq = torch.tensor(seq, dtype=torch.long)
    write_at = _flat(items, "write_at")
    slots = block_table[row_seq, write_at // PAGE_SIZE].long() * PAGE_SIZE + write_at % PAGE_SIZE
    row_len = _flat(items, "row_len")
    row_bits = _flat(items, "row_bits")
    extra = torch.tensor([bin(b & (2**64 - 1)).count("1") for it in items for b in it.row_bits], dtype=torch.long)
    plan = AttentionPlan(block_table, row_seq.to(torch.int32), row_len.to(torch.int32), row_bits,
                         int((row_len + extra).max()))
    return PackedBatch(items, _flat(items, "tokens"), _flat(items, "positions"), slots, plan, offsets,
                       torch.tensor(flat_rows, dtype=torch.long), _adapter_rows(items, offsets))


def _adapter_rows(items: list[SeqInput], offsets: list[int]) -> list[tuple[str, torch.Tensor]]:
    """Rows of each LoRA adapter in the batch (first-seen order; rows of no adapter left out)."""
    rows: dict[str, list[int]] = {}
    for it, off in zip(items, offsets):
        if it.adapter is not None:
            rows.setdefault(it.adapter, []).extend(range(off, off + len(it.tokens)))
    return [(name, torch.tensor(r, dtype=torch.long)) for name, r in rows.items()]


def _flat(items: list[SeqInput], field: str) -> torch.Tensor:
    """One per-row field of every item, concatenated: [N] long."""
    return torch.tensor([x for it in items for x in getattr(it, field)], dtype=torch.long)
