"""Per-session KV cache for a contiguous slice of decoder layers.

Each session owns one growable buffer per K and V, ``[layers, kv_heads, capacity,
head_dim]``; ``length`` entries are valid and always equal the session's prefix minus
its root (DESIGN.md step 4). Verification appends the forward's KV for the root and the
accepted path only ("commit"); entries of rejected nodes never enter the buffer, so
rollback is free. ``truncate`` rolls a session back to a shorter prefix.
A pipeline stage (sharded verifier) holds the same structure for its own layers.
"""

from __future__ import annotations

import torch


class SessionKV:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", capacity: int = 64):
        shape = (num_layers, kv_heads, max(capacity, 1), head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, H, cap, d]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, H, cap, d]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty(old.shape[:2] + (cap,) + old.shape[3:], dtype=old.dtype, device=old.device)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """k_new, v_new: [L, H, t, d] -> appended after the valid entries."""
        t = k_new.shape[2]
        self._reserve(self.length + t)
        self.k[:, :, self.length : self.length + t] = k_new
        self.v[:, :, self.length : self.length + t] = v_new
        self.length += t

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate KV of length {self.length} to {length}")
        self.length = length

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep entries ``[0, start)`` then ``rows`` (indices >= start, in the given order).

        Used by the edge drafter to compact draft-tree KV to the accepted path.
        """
        if not 0 <= start <= self.length or any(not start <= r < self.length for r in rows):
            raise ValueError(f"cannot keep rows {rows} after {start} of a KV of length {self.length}")
        if rows:
            idx = torch.tensor(rows, dtype=torch.long, device=self.k.device)
            k_sel = self.k[:, :, : self.length].index_select(2, idx)  # [L, H, r, d] (a copy)
            v_sel = self.v[:, :, : self.length].index_select(2, idx)
            self.k[:, :, start : start + len(rows)] = k_sel
            self.v[:, :, start : start + len(rows)] = v_sel
        self.length = start + len(rows)

    def keys(self) -> torch.Tensor:  # [L, H, length, d]
        return self.k[:, :, : self.length]

    def values(self) -> torch.Tensor:  # [L, H, length, d]
        return self.v[:, :, : self.length]

    def nbytes(self) -> int:
        return 2 * self.k.element_size() * self.k[:, :, :1].numel() * self.capacity
