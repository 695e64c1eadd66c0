"""The simulated target: a synthetic language model behind the engine's runner interface, whose
forwards take the seconds a cost profile gives them (issue 61).

The engine (:class:`specdec.engine.VerifierEngine`) runs unmodified on :class:`SimRunner`: its
sessions, prefill chunks, tree walks and KV bookkeeping are the production code; only the
forward is modelled. Its logits put all mass on :func:`next_token` of each row's token and
position (a synthetic target every simulated edge can compute too, so drafts can be right or
wrong on purpose), and it spends :meth:`sim.cost_profile.CostProfile.seconds` of its
batch on the worker's virtual clock. KV is bookkeeping only: lengths per session, capacity in
tokens. Pure module: no Ray.
"""

from __future__ import annotations

import math
import random

import torch

from sim.cost_profile import Chunk, CostProfile, Forward
from specdec.errors import KVCapacityExceeded
from specdec.model.batch import SeqInput
from specdec.model.native import PAGE_SIZE

SIM_VOCAB = 512  # token ids of the synthetic target (its cost is the profile's, whatever this is)
LOW_TOKEN = 3  # ids below are special (EOS among them): the target never emits them


def next_token(token: int, position: int, vocab: int = SIM_VOCAB) -> int:
    """The synthetic target's greedy choice after ``token`` at ``position``."""
    return LOW_TOKEN + (token * 7919 + position * 104729 + 17) % (vocab - LOW_TOKEN)


def continuation(prompt: list[int], n: int, vocab: int = SIM_VOCAB) -> list[int]:
    """The target's ``n`` next tokens after ``prompt`` (what greedy decoding gives)."""
    out, tok, pos = [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        tok = next_token(tok, pos, vocab)
        pos += 1
        out.append(tok)
    return out


class SimRunner:
    """The engine's runner (:class:`specdec.model.runner.ModelRunner`'s interface) for the
    synthetic target; ``spend(seconds)``: the virtual clock's, called once per forward."""

    is_first = is_last = True
    first = 0

    def __init__(self, profile: CostProfile, spend, capacity_tokens: int, vocab: int = SIM_VOCAB,
                 rng: random.Random | None = None):
        """``rng``: draws each forward's spread around its cost (the profile's ``spread``); None: none."""
        self.profile, self.spend, self.capacity, self.vocab = profile, spend, capacity_tokens, vocab
        self.rng = rng
        self.lengths: dict[str, int] = {}  # committed KV per session
        self._pending: dict[int, list[str]] = {}
        self.forwards = 0
        self.busy_seconds = 0.0

    # -- KV bookkeeping --------------------------------------------------------------
    def kv_length(self, sid: str) -> int:
        return self.lengths.get(sid, 0)

    def kv_tokens(self) -> int:
        return sum(self.lengths.values())

    def kv_used_tokens(self) -> int:
        return sum(-(-n // PAGE_SIZE) * PAGE_SIZE for n in self.lengths.values())

    def drop(self, sid: str) -> None:
        self.lengths.pop(sid, None)

    def truncate(self, sid: str, length: int) -> None:
        self.lengths[sid] = min(self.lengths.get(sid, 0), length)

    def share_prefix(self, sid: str, tokens: list[int], salt=None) -> int:
        return 0  # no prefix cache in the simulation

    def cache_prefix(self, sid: str, tokens: list[int], salt=None) -> None:
        pass

    def prefix_stats(self) -> dict | None:
        return None

    def session_kv(self, sid: str):
        return None

    # -- forward -------------------------------------------------------------------
    def forward(self, batch_id: int, items: list[SeqInput], hidden=None, on_layer=None) -> list[torch.Tensor]:
        """One logits tensor [len(logit_rows), V] per item; spends the profile's seconds."""
        new = sum(len(it.tokens) for it in items)
        if self.kv_tokens() + new > self.capacity:
            raise KVCapacityExceeded(f"the simulated KV pool of {self.capacity} tokens is full")
        self._pending[batch_id] = [it.sid for it in items]
        rounds, chunks = [], []
        for it in items:  # a prefill chunk wants its last row's logits only; a verify item every row's
            (rounds if len(it.logit_rows) == len(it.tokens) else chunks).append(it)
        seconds = self.profile.seconds(Forward(tuple(len(it.tokens) for it in rounds),
                                               tuple(self.kv_length(it.sid) for it in rounds)),
                                       tuple(Chunk(len(it.tokens), self.kv_length(it.sid)) for it in chunks))
        if self.rng is not None and self.profile.spread:
            seconds *= math.exp(self.rng.gauss(0.0, self.profile.spread))
        self.forwards += 1
        self.busy_seconds += seconds
        self.spend(seconds)
        out = []
        for it in items:
            logits = torch.zeros(len(it.logit_rows), self.vocab)  # [rows wanted, V]
            for j, r in enumerate(it.logit_rows):
                logits[j, next_token(it.tokens[r], it.positions[r], self.vocab)] = 1.0
            out.append(logits)
        return out

    def commit(self, batch_id: int, keep: dict) -> None:
        for sid in self._pending.pop(batch_id, []):
            if sid in keep:
                n_contiguous, tree_positions = keep[sid]
                self.lengths[sid] = self.lengths.get(sid, 0) + n_contiguous + len(tree_positions)

    def hold(self, batch_id: int) -> None:
        self._pending.pop(batch_id, None)

    def abort(self, batch_id: int) -> None:
        self._pending.pop(batch_id, None)
