"""Paged KV pool, preallocated per replica (or per pipeline stage), written and read in place; rollback is free.
K ``[L, pages, Hkv, D, PS]``, V ``[L, pages, Hkv, PS, D]`` (PS: :data:`PAGE_SIZE`); a round: docs/specdec.md."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import KVCapacityExceeded
from specdec.model import hugepages
from specdec.model.native import PAGE_SIZE
from specdec.model.prefix_cache import PrefixCache


@dataclass
class SessionPages:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # committed logical positions


class KVPool:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", prefix_caching: bool = False):
        self.num_pages = max(1, -(-capacity_tokens // PAGE_SIZE))
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        # empty: memory is committed as pages are first written; on a CPU in huge pages (2 MiB:
        # a row's KV pages lie scattered over the pool, and each 4 KiB one was a TLB miss)
        self.k = hugepages.empty((num_layers, self.num_pages, kv_heads, head_dim, PAGE_SIZE), dtype, device)
        self.v = hugepages.empty((num_layers, self.num_pages, kv_heads, PAGE_SIZE, head_dim), dtype, device)
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: low page ids first
        self.sessions: dict[str, SessionPages] = {}
        self._scratch: int | None = None  # a page no session owns (scratch_slot)
        self.prefix_cache = PrefixCache(PAGE_SIZE) if prefix_caching else None

    # -- accounting -----------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * PAGE_SIZE

    @property
    def pages_free(self) -> int:
        """Pages a reservation can take: free ones and cached ones no session holds."""
        return len(self._free) + (self.prefix_cache.idle_pages if self.prefix_cache else 0)

    @property
    def pages_in_use(self) -> int:
        """Pages the sessions hold (the scratch page is not theirs); a shared page counts once."""
        return self.num_pages - self.pages_free - (self._scratch is not None)

    @property
    def tokens(self) -> int:
        """Committed KV tokens of all sessions."""
        return sum(s.length for s in self.sessions.values())

    def length(self, sid: str) -> int:
        s = self.sessions.get(sid)
        return s.length if s is not None else 0

    # -- sessions -------------------------------------------------------------------
    def reserve(self, sid: str, end: int) -> None:
        """Pages for logical positions ``[0, end)`` of ``sid`` (the session is created if new)."""
        s = self.sessions.setdefault(sid, SessionPages())
        need = -(-end // PAGE_SIZE) - len(s.pages)
        if need > self.pages_free:
            if not s.pages:
                del self.sessions[sid]
            raise KVCapacityExceeded(f"KV pool full: {need} more pages needed, {self.pages_free} free "
                                     f"of {self.num_pages}")
        for _ in range(need):
            s.pages.append(self._take())

    def _take(self) -> int:
        """A free page, else the least recently released cached page nobody holds."""
        if self._free:
            return self._free.pop()
        page = self.prefix_cache.evict() if self.prefix_cache else None
        if page is None:
            raise KVCapacityExceeded(f"KV pool full: no page free of {self.num_pages}")
        return page

    def _give_back(self, page: int) -> None:
        """A session's page: back to the free list, or (cached) one holder fewer."""
        if self.prefix_cache is None or not self.prefix_cache.release(page):
            self._free.append(page)

    def scratch_slot(self) -> int:
        """A slot no session will ever own, for rows whose K/V nobody reads (a CUDA graph's padding rows)."""
        if self._scratch is None:
            self._scratch = self._take()
        return self._scratch * PAGE_SIZE

    def _trim(self, s: SessionPages, end: int | None = None) -> None:
        keep = -(-(s.length if end is None else end) // PAGE_SIZE)
        while len(s.pages) > keep:  # the deepest page first
            self._give_back(s.pages.pop())

    def release(self, sid: str) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            s.length = 0
            self._trim(s)

    def truncate(self, sid: str, length: int) -> None:
        s = self.sessions[sid]
        if not 0 <= length <= s.length:
            raise ValueError(f"cannot truncate KV of length {s.length} to {length}")
        s.length = length
        self._trim(s)
        last = length // PAGE_SIZE  # the page the session writes into next
        if length % PAGE_SIZE and self.prefix_cache is not None and self.prefix_cache.cached(s.pages[last]):
            self._copy_page(s, last)

    def _copy_page(self, s: SessionPages, i: int) -> None:
        """Give the session a page of its own in place of its ``i``-th, with the same contents."""
        page = self._take()
        self.k[:, page], self.v[:, page] = self.k[:, s.pages[i]], self.v[:, s.pages[i]]
        self._give_back(s.pages[i])
        s.pages[i] = page

    # -- prefix caching ---------------------------------------------------------------
    def share(self, sid: str, tokens: list[int], salt=None) -> int:
        """Start new session ``sid`` on the cached pages of ``tokens``' longest cached prefix (whole pages, at
        least one token left to compute); returns its committed length (0 without prefix caching)."""
        if self.prefix_cache is None:
            return 0
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} already holds KV")
        pages = self.prefix_cache.match(tokens, salt, (len(tokens) - 1) // PAGE_SIZE)
        if pages:
            self.sessions[sid] = SessionPages(pages, len(pages) * PAGE_SIZE)
        return len(pages) * PAGE_SIZE

    def cache(self, sid: str, tokens: list[int], salt=None) -> None:
        """Offer ``sid``'s whole committed pages to later sessions; ``tokens``: its KV's tokens, one per position."""
        s = self.sessions.get(sid)
        if self.prefix_cache is not None and s is not None:
            self.prefix_cache.add(s.pages, tokens[: s.length], salt)

    def abort(self, sid: str) -> None:
        """Drop every reserved, uncommitted position (rollback)."""
        s = self.sessions.get(sid)
        if s is not None:
            self._trim(s)

    def slots(self, sid: str, positions: torch.Tensor) -> torch.Tensor:
        """Global slot ids (page * PS + offset) of logical ``positions`` [n] of ``sid``."""
        pages = torch.tensor(self.sessions[sid].pages, dtype=torch.long)
        return pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE

    def block_table(self, sids: list[str]) -> torch.Tensor:
        """[B, max_pages] int32 (unused entries 0)."""
        width = max(1, max(len(self.sessions[s].pages) for s in sids))
        bt = torch.zeros(len(sids), width, dtype=torch.int32)
        for b, sid in enumerate(sids):
            p = self.sessions[sid].pages
            bt[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
        return bt

    # -- data -----------------------------------------------------------------------
    @staticmethod
    def locate(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global slots [n] -> (page, offset) [n] each (computed once per forward)."""
        return slots // PAGE_SIZE, slots % PAGE_SIZE

    def write(self, layer: int, where: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, Hkv, D] -> their (page, offset) ``where`` of ``layer``."""
        page, off = where
        self.k[layer][page, :, :, off] = k
        self.v[layer][page, :, off, :] = v

    def commit(self, sid: str, keep_contiguous: int, tree_positions: list[int]) -> None:
        """Keep ``[length, length + keep_contiguous)`` and then ``tree_positions`` (increasing,
        beyond them), moved down behind; the session's length grows by all of them."""
        s = self.sessions[sid]
        start = s.length + keep_contiguous
        self.compact(sid, start, tree_positions, start + len(tree_positions))

    def compact(self, sid: str, start: int, positions: list[int], committed: int) -> None:
        """Move ``positions`` (increasing, each >= start) to ``start, start + 1, ...``; the committed length becomes
        ``committed`` (<= start + len(positions)); entries past it stay written, uncommitted."""
        s = self.sessions[sid]
        moves = [(p, start + i) for i, p in enumerate(positions) if p != start + i]
        if moves:
            src = self.slots(sid, torch.tensor([m[0] for m in moves]))
            dst = self.slots(sid, torch.tensor([m[1] for m in moves]))
            sp, so, dp, do = src // PAGE_SIZE, src % PAGE_SIZE, dst // PAGE_SIZE, dst % PAGE_SIZE
            self.k[:, dp, :, :, do] = self.k[:, sp, :, :, so]  # [L, n, Hkv, D] gathered, then scattered
            self.v[:, dp, :, do, :] = self.v[:, sp, :, so, :]
        s.length = committed
        self._trim(s, start + len(positions))

    def read(self, sid: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A session's committed KV, keys and values [L, Hkv, length, D] (a copy, for checks)."""
        s = self.sessions.get(sid)
        if s is None or s.length == 0:
            shape = (self.num_layers, self.kv_heads, 0, self.head_dim)
            return torch.empty(shape, dtype=self.k.dtype), torch.empty(shape, dtype=self.v.dtype)
        slots = self.slots(sid, torch.arange(s.length))
        page, off = slots // PAGE_SIZE, slots % PAGE_SIZE
        k = self.k[:, page, :, :, off]  # [n, L, Hkv, D]: separated advanced indices come first
        v = self.v[:, page, :, off, :]
        return k.permute(1, 2, 0, 3).cpu(), v.permute(1, 2, 0, 3).cpu()
