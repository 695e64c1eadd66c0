"""Runs a (slice of a) decoder-only HF model over a padded batch of per-session inputs.

One forward serves many sessions at once (DESIGN.md step 4): each batch item is a
session's KV prefix plus a few new tokens (a draft tree behind its root, or a prompt
chunk) with its own local attention mask. The batch is right-padded in the new tokens
and left-padded in the KV prefix; positions are explicit (prefix length + node depth),
so padding never shifts RoPE. The runner drives the HF modules directly
(``embed_tokens``, ``layers[a:b]``, ``norm``, ``lm_head``), which lets one process own
all layers or a pipeline stage own a contiguous slice of them (sharded verifier).
Supported: Llama-family models whose decoder layers take
``(hidden, attention_mask, position_embeddings, position_ids, past_key_values)``
(Llama, Mistral, Qwen2/3, SmolLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deploy.verifier.kv_cache import SessionKV


@dataclass
class BatchItem:
    """One session's share of a forward."""

    sid: str
    input_ids: list[int]  # the new tokens (root + tree nodes, or prompt tokens)
    position_offsets: torch.Tensor  # [t] long: position = kv length + offset
    local_mask: torch.Tensor  # [t, t] bool: which new tokens each new token sees
    logit_rows: list[int] = field(default_factory=list)  # rows whose logits are wanted
    # [t, L] bool: which of the session's L KV entries each new token sees; None = all.
    # The edge drafter keeps draft-tree node KV in the cache and masks it per node.
    kv_mask: torch.Tensor | None = None


class _PaddedKV:
    """Duck-typed HF cache: past KV of the batch in one buffer, new KV written behind it."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], past_len: int, layer_offset: int):
        self.k, self.v = k, v  # [L_local, B, H, P + T, d]
        self.past_len = past_len
        self.layer_offset = layer_offset

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [B, H, T, d]
        i = layer_idx - self.layer_offset
        t = key_states.shape[2]
        self.k[i][:, :, self.past_len : self.past_len + t] = key_states
        self.v[i][:, :, self.past_len : self.past_len + t] = value_states
        return self.k[i], self.v[i]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past_len


class LayerRunner:
    """Owns decoder layers ``[first, last)`` of a model and their per-session KV."""

    def __init__(self, model, first: int = 0, last: int | None = None):
        inner = model.model
        n = len(inner.layers)
        self.first, self.last = first, n if last is None else last
        self.is_first, self.is_last = self.first == 0, self.last == n
        self.layers = inner.layers[self.first : self.last]
        self.embed = inner.embed_tokens if self.is_first else None
        self.norm = inner.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.rotary = inner.rotary_emb
        cfg = model.config
        self.config = cfg
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.eager = cfg._attn_implementation == "eager"
        self.kv: dict[str, SessionKV] = {}
        self._pending: dict[int, tuple[list[str], list[torch.Tensor], list[torch.Tensor], int]] = {}

    # -- session KV -------------------------------------------------------------
    def kv_length(self, sid: str) -> int:
        kv = self.kv.get(sid)
        return kv.length if kv is not None else 0

    def drop(self, sid: str) -> None:
        self.kv.pop(sid, None)

    def truncate(self, sid: str, length: int) -> None:
        self.kv[sid].truncate(length)

    def keep(self, sid: str, start: int, rows: list[int]) -> None:
        """Compact a session's KV to entries ``[0, start)`` followed by ``rows`` (each >= start)."""
        self.kv[sid].keep(start, rows)

    def kv_tokens(self) -> int:
        return sum(kv.length for kv in self.kv.values())

    def _session_kv(self, sid: str) -> SessionKV:
        kv = self.kv.get(sid)
        if kv is None:
            kv = self.kv[sid] = SessionKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)
        return kv

    # -- forward ------------------------------------------------------------------
    def build_inputs(self, items: list[BatchItem]):
        """Padded input ids, positions and the 4D attention mask for ``items``.

        Returns input_ids [B, T], position_ids [B, T], mask [B, 1, T, P + T], P.
        """
        B = len(items)
        T = max(len(it.input_ids) for it in items)
        lens = [self.kv_length(it.sid) for it in items]
        P = max(lens)
        input_ids = torch.zeros(B, T, dtype=torch.long)
        positions = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, 1, T, P + T, dtype=torch.bool)
        for b, (it, L) in enumerate(zip(items, lens)):
            t = len(it.input_ids)
            input_ids[b, :t] = torch.tensor(it.input_ids, dtype=torch.long)
            positions[b, :t] = L + it.position_offsets
            positions[b, t:] = L
            if it.kv_mask is None:
                mask[b, 0, :t, P - L : P] = True  # the session's prefix (left-padded)
            else:
                mask[b, 0, :t, P - L : P] = it.kv_mask.to(torch.bool)
            mask[b, 0, :t, P : P + t] = it.local_mask
            mask[b, 0, t:, P + t :] = torch.eye(T - t, dtype=torch.bool)  # padding rows see themselves only
        return input_ids.to(self.device), positions.to(self.device), mask.to(self.device), P

    @torch.inference_mode()
    def forward(self, batch_id: int, items: list[BatchItem], hidden: torch.Tensor | None = None):
        """Run this runner's layers. First stage takes token ids, later ones ``hidden``.

        Returns hidden [B, T, D] (not the last stage) or, on the last stage, a list of
        logits tensors, one [len(logit_rows), vocab] float32 per item.
        The new KV is kept until :meth:`commit` says which rows each session keeps.
        """
        input_ids, positions, mask, P = self.build_inputs(items)
        B, T = input_ids.shape
        lens = [self.kv_length(it.sid) for it in items]
        nl = len(self.layers)
        # zeros, not empty: padded KV slots must be finite even though they are masked
        ks = torch.zeros(nl, B, self.kv_heads, P + T, self.head_dim, dtype=self.dtype, device=self.device)
        vs = torch.zeros_like(ks)  # [L, B, H, P + T, d]
        for b, (it, L) in enumerate(zip(items, lens)):
            if L:
                kv = self.kv[it.sid]
                ks[:, b, :, P - L : P] = kv.k[:, :, :L]
                vs[:, b, :, P - L : P] = kv.v[:, :, :L]
        cache = _PaddedKV(ks, vs, P, self.first)
        if self.eager:  # eager attention adds the mask; SDPA takes it as bool
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(self.dtype).min)

        h = self.embed(input_ids) if self.is_first else hidden.to(self.device, self.dtype)
        pos_emb = self.rotary(h, position_ids=positions)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=pos_emb, position_ids=positions,
                      past_key_values=cache, use_cache=True)
        self._pending[batch_id] = ([it.sid for it in items], ks, vs, P)
        if not self.is_last:
            return h
        h = self.norm(h)
        # one LM-head matmul over the wanted rows of every item, then split per item
        b_idx = torch.tensor([b for b, it in enumerate(items) for _ in it.logit_rows], dtype=torch.long)
        r_idx = torch.tensor([r for it in items for r in it.logit_rows], dtype=torch.long)
        logits = self.lm_head(h[b_idx.to(self.device), r_idx.to(self.device)]).float()  # [sum rows, V]
        return list(torch.split(logits, [len(it.logit_rows) for it in items]))

    def commit(self, batch_id: int, keep: dict[str, list[int]]) -> None:
        """Append the KV of the kept forward rows to each session; drop the rest.

        ``keep[sid]`` lists row indices into that session's new tokens (root and accepted
        path for a verify; all rows for a prefill). Sessions absent from ``keep`` get
        nothing appended.
        """
        sids, ks, vs, P = self._pending.pop(batch_id)
        for b, sid in enumerate(sids):
            rows = keep.get(sid)
            if not rows:
                continue
            idx = torch.tensor(rows, dtype=torch.long, device=self.device) + P
            k_new = ks[:, b].index_select(2, idx)  # [L, H, r, d]
            v_new = vs[:, b].index_select(2, idx)
            self._session_kv(sid).append(k_new, v_new)

    def abort(self, batch_id: int) -> None:
        self._pending.pop(batch_id, None)
