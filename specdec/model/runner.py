"""A model slice with its KV pool: the one forward every caller uses (the engine, pipeline stages, the edge drafter)."""

from __future__ import annotations

import torch

from specdec.model.batch import SeqInput, pack
from specdec.model.decoder import DecoderModel
from specdec.model.native import PAGE_SIZE

Keep = tuple[int, list[int]]  # (contiguous new positions kept, then these tree positions)


class ModelRunner:
    def __init__(self, model, first: int = 0, last: int | None = None, kv_capacity_tokens: int = 1 << 16,
                 compile: bool = False, prefix_caching: bool = False):
        self.model = model if isinstance(model, DecoderModel) else DecoderModel(model, first, last, compile)
        if compile:
            self.model.warmup()
        self.pool = self.model.new_pool(kv_capacity_tokens, prefix_caching)
        self.first, self.last = self.model.first, self.model.last
        self.is_first, self.is_last = self.model.is_first, self.model.is_last
        self.dtype, self.device = self.model.dtype, self.model.device
        self._pending: dict[int, list[str]] = {}

    # -- session KV ---------------------------------------------------------------
    def kv_length(self, sid: str) -> int:
        return self.pool.length(sid)

    def kv_tokens(self) -> int:
        """Committed KV tokens of all sessions."""
        return self.pool.tokens

    def kv_used_tokens(self) -> int:
        """Pool capacity held: whole pages (what memory the sessions really take)."""
        return self.pool.pages_in_use * PAGE_SIZE

    def drop(self, sid: str) -> None:
        self.pool.release(sid)

    def truncate(self, sid: str, length: int) -> None:
        self.pool.truncate(sid, length)

    def share_prefix(self, sid: str, tokens: list[int], salt=None) -> int:
        """Start ``sid`` on its tokens' longest cached prefix (whole pages); returns the positions not to compute."""
        return self.pool.share(sid, tokens, salt)

    def cache_prefix(self, sid: str, tokens: list[int], salt=None) -> None:
        """Offer ``sid``'s committed KV (``tokens``, position by position) to later sessions."""
        self.pool.cache(sid, tokens, salt)

    def prefix_stats(self) -> dict | None:
        """Pages cached and, of them, idle; None without prefix caching."""
        c = self.pool.prefix_cache
        return c.stats() if c is not None else None

    def session_kv(self, sid: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """keys, values [L_local, Hkv, length, d] (copies), or None for an unknown session."""
        return self.pool.read(sid) if sid in self.pool.sessions else None

    # -- forward ------------------------------------------------------------------
    def forward(self, batch_id: int, items: list[SeqInput], hidden: torch.Tensor | None = None, on_layer=None):
        """Hidden states [N, D] (not the last slice) or, on the last, one logits tensor [len(logit_rows), V] per
        item, in the model dtype. ``on_layer``: see :meth:`specdec.model.decoder.DecoderModel.forward`."""
        if batch_id in self._pending:
            raise ValueError(f"batch {batch_id} is already in flight")
        reserved: list[str] = []
        try:
            for it in items:
                self.pool.reserve(it.sid, max(it.write_at) + 1)
                reserved.append(it.sid)
            batch = pack(items, self.pool)
            self._pending[batch_id] = [it.sid for it in items]
            h = self.model.forward(batch, self.pool, hidden, on_layer)
        except BaseException:
            self._pending.pop(batch_id, None)
            for sid in reserved:
                self.pool.abort(sid)
            raise
        if not self.is_last:
            return h
        return batch.split_logits(self.model.logits(h[batch.logit_index.to(h.device)]))

    def commit(self, batch_id: int, keep: dict[str, Keep]) -> None:
        """Keep per session the entries ``keep`` names, roll back the rest; one dropped meanwhile stays dropped."""
        for sid in self._pending.pop(batch_id, []):
            if sid not in self.pool.sessions:
                continue
            if sid in keep:
                n_contiguous, tree_positions = keep[sid]
                self.pool.commit(sid, n_contiguous, list(tree_positions))
            else:
                self.pool.abort(sid)

    def hold(self, batch_id: int) -> None:
        """Leave the batch's new entries written past each session's committed length."""
        self._pending.pop(batch_id, None)

    def abort(self, batch_id: int) -> None:
        for sid in self._pending.pop(batch_id, []):
            self.pool.abort(sid)
