"""Draft backends: what proposes the children of a draft-tree node (one :class:`Drafter` interface).

:class:`ModelDrafter`: a Llama-family HF causal LM sharing the target's tokenizer, on the verifier's
forward and KV pool; :class:`NgramDrafter`: prompt lookup, no model, no KV.
Notes: docs/edge_agent.md, "edge_agent/draft_backends.py"."""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

from edge_agent.tree_builder import ROOT
from specdec.model.batch import MAX_TREE_BITS, SeqInput, chunk_input, signed64
from specdec.model.decoder import DecoderModel
from specdec.model.runner import ModelRunner

_PACKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF draft model -> its DecoderModel
_PACKED_LOCK = threading.Lock()


def packed_model(model) -> DecoderModel:
    """The forward-ready (packed) copy of a draft model's weights, one per model object in a
    process, shared by all its drafters (the forward is stateless: each drafter's KV is its own)."""
    if isinstance(model, DecoderModel):
        return model
    with _PACKED_LOCK:
        dm = _PACKED.get(model)
        if dm is None:
            dm = _PACKED[model] = DecoderModel(model)
        return dm

Candidates = tuple[list[int], list[float]]  # (target token ids, log-probs), best first


@dataclass(frozen=True)
class ExpandRequest:
    """One node to feed: its token, depth and the ids/tokens of its ancestors below the root."""

    nid: int  # node id, ROOT for the root (= prefix[-1])
    token: int
    depth: int  # 0 for the root
    ancestors: tuple[int, ...] = ()  # node ids, root's child first, excluding nid
    path_tokens: tuple[int, ...] = ()  # tokens of ancestors + own token (empty for the root)


class Drafter:
    """Interface of a draft backend."""

    name: str = "drafter"
    vocab_size: int | None = None  # the input vocabulary (target ids it accepts), None = any

    def expand(self, prefix: list[int], reqs: list[ExpandRequest], k: int) -> list[Candidates]:
        """Feed ``reqs`` (one draft forward) and return each node's top-``k`` next tokens."""
        raise NotImplementedError

    def room(self) -> int:
        """Tree nodes that can still be fed below the current prefix (unbounded here)."""
        return 1 << 30

    def next_logits(self, prefix: list[int], reqs: list[ExpandRequest], vocab_size: int) -> list[torch.Tensor | None]:
        """Like :meth:`expand`, but each node's whole next-token distribution: [vocab_size]
        float32 log-probabilities over the target's ids on the CPU (-inf: never proposed), or
        None when the drafter proposes nothing there. Chain rejection sampling needs q in full."""
        out = []
        for toks, lps in self.expand(prefix, reqs, vocab_size):
            if not toks:
                out.append(None)
                continue
            row = torch.full((vocab_size,), float("-inf"))
            row[torch.tensor(toks, dtype=torch.long)] = torch.tensor(lps, dtype=torch.float32)
            out.append(torch.log_softmax(row, dim=-1))
        return out

    def advance(self, prefix: list[int], path_ids: list[int], live_ids: list[int]) -> None:
        """The verified prefix is now ``prefix``; the state of fed nodes ``path_ids`` (in
        order) becomes part of it, ``live_ids`` stay as nodes of the next tree; every
        other node is dropped."""

    def reset(self) -> None:
        """Forget all state (a new, unrelated generation)."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDrafter(Drafter):
    """A draft LM with tree KV and rollback (Llama-family, the verifier's forward)."""

    SID = "draft"

    def __init__(self, model, vocab_map: torch.Tensor | None = None, name: str | None = None,
                 max_context: int | None = None):
        self.model = model
        ctx = max_context or getattr(model.config, "max_position_embeddings", 8192)
        self.runner = ModelRunner(packed_model(model), kv_capacity_tokens=min(ctx, 1 << 15) + 2 * MAX_TREE_BITS)
        vm = vocab_map if vocab_map is not None else getattr(model, "vocab_map", None)
        self.vocab_map = vm.long().to(self.runner.device) if vm is not None else None  # [V_draft]
        self.vocab_size = model.config.vocab_size
        self.name = name or type(model).__name__
        self.cached: list[int] = []  # prefix tokens whose KV is committed
        self.slots: dict[int, int] = {}  # node id -> its KV position (>= len(cached), uncommitted)
        self._bids = itertools.count()

    def reset(self) -> None:
        self.runner.drop(self.SID)
        self.cached, self.slots = [], {}

    @property
    def kv_length(self) -> int:
        return self.runner.kv_length(self.SID)

    def _truncate(self, n: int) -> None:
        if self.kv_length > n:
            self.runner.truncate(self.SID, n)
        self.cached = self.cached[:n]
        self.slots = {}

    def _topk(self, logits: torch.Tensor, k: int) -> Candidates:
        """logits: [V_draft] -> top-k (target ids, log-probs)."""
        lp = torch.log_softmax(logits.float(), dim=-1)  # [V_draft]
        vals, idx = torch.topk(lp, min(k, lp.shape[-1]))
        if self.vocab_map is not None:
            idx = self.vocab_map[idx]
        return idx.tolist(), vals.tolist()

    def _run(self, item: SeqInput, commit: bool) -> torch.Tensor:
        bid = next(self._bids)
        try:
            logits = self.runner.forward(bid, [item])[0]  # [rows, V_draft]
        except BaseException:
            self.runner.abort(bid)
            raise
        if commit:
            self.runner.commit(bid, {self.SID: (len(item.tokens), [])})
        else:
            self.runner.hold(bid)  # tree nodes stay written past the committed prefix
        return logits

    def expand(self, prefix: list[int], reqs: list[ExpandRequest], k: int) -> list[Candidates]:
        logits = self._feed(prefix, reqs)
        return [self._topk(logits[i], k) for i in range(len(reqs))]

    def next_logits(self, prefix: list[int], reqs: list[ExpandRequest], vocab_size: int) -> list[torch.Tensor | None]:
        lp = torch.log_softmax(self._feed(prefix, reqs).float(), dim=-1).cpu()  # [n, V_draft]
        if self.vocab_map is None and lp.shape[-1] == vocab_size:
            return list(lp)
        full = torch.full((len(reqs), vocab_size), float("-inf"))
        cols = self.vocab_map.cpu() if self.vocab_map is not None else torch.arange(min(lp.shape[-1], vocab_size))
        full[:, cols] = lp[:, : len(cols)]
        return list(full)

    def room(self) -> int:
        """Tree nodes that can still be fed this round: the fed nodes of a round (the tree,
        nodes it later dropped, the proactive chain) take KV positions past the cached
        prefix, at most ``MAX_TREE_BITS`` of them (the attention plan's bitmask)."""
        return len(self.cached) + MAX_TREE_BITS - self._next_position()

    def _next_position(self) -> int:
        """The KV position the next fed tree node takes (right after the fed ones)."""
        return max(self.slots.values(), default=len(self.cached) - 1) + 1

    def _feed(self, prefix: list[int], reqs: list[ExpandRequest]) -> torch.Tensor:
        """One draft forward over ``reqs``; their next-token logits [len(reqs), V_draft]."""
        if any(r.nid == ROOT for r in reqs):
            if len(reqs) != 1:
                raise ValueError("the root is expanded alone (no node exists below an unfed root)")
            # the root's logits come from feeding prefix[c:]; keep at most prefix[:-1] cached
            c = min(common_prefix(self.cached, prefix), len(prefix) - 1)
            self._truncate(c)
            logits = self._run(chunk_input(self.SID, c, prefix[c:]), commit=True)
            self.cached = list(prefix)
            return logits[:1]
        if self.cached != prefix[: len(self.cached)] or len(self.cached) != len(prefix):
            raise RuntimeError("draft KV is not at the verified prefix; expand the root first")
        c = len(self.cached)
        nxt = self._next_position()
        if nxt + len(reqs) > c + MAX_TREE_BITS:  # more than room()
            raise ValueError(f"the draft tree would feed more than {MAX_TREE_BITS} nodes; lower its budget")
        pos = dict(self.slots)
        for i, r in enumerate(reqs):
            pos[r.nid] = nxt + i
        bits = []
        for r in reqs:
            b = 0
            for a in (*r.ancestors, r.nid):
                b |= 1 << (pos[a] - c)
            bits.append(signed64(b))
        root_pos = len(prefix) - 1
        item = SeqInput(self.SID, [r.token for r in reqs], [root_pos + r.depth for r in reqs],
                        [pos[r.nid] for r in reqs], [c] * len(reqs), bits, list(range(len(reqs))))
        logits = self._run(item, commit=False)
        for r in reqs:
            self.slots[r.nid] = pos[r.nid]
        return logits

    def fed(self, nid: int) -> bool:
        return nid in self.slots

    def advance(self, prefix: list[int], path_ids: list[int], live_ids: list[int]) -> None:
        c = len(self.cached)
        if c == 0 or self.cached != prefix[:c]:
            self._truncate(common_prefix(self.cached, prefix))
            return
        path_pos = []
        for nid in path_ids:  # the longest fed prefix of the path
            if nid not in self.slots:
                break
            path_pos.append(self.slots[nid])
        if len(path_pos) < len(path_ids):
            live_ids = []
        live_ids = [n for n in live_ids if n in self.slots]
        new_c = min(c + len(path_pos), len(prefix))
        path_pos = path_pos[: new_c - c]
        if self.SID in self.runner.pool.sessions:
            self.runner.pool.compact(self.SID, c, path_pos + [self.slots[n] for n in live_ids], new_c)
        self.cached = list(prefix[:new_c])
        self.slots = {n: new_c + j for j, n in enumerate(live_ids)}


class NgramDrafter(Drafter):
    """Prompt lookup: propose what followed the longest earlier match of the context's suffix.
    A node's candidates follow the longest matching n-gram (``max_n`` down to ``min_n``) of the
    verified prefix, by count then recency, log-prob log(count/total). Why apart from the server's
    ``PromptLookupDrafter``: docs/edge_agent.md, "Two prompt-lookup drafters"."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.reset()

    def reset(self) -> None:
        self.indexed: list[int] = []
        # index[n][ngram] = {next_token: [count, last_position]}
        self.index: dict[int, dict[tuple, dict[int, list[int]]]] = {
            n: defaultdict(dict) for n in range(self.min_n, self.max_n + 1)}

    def _index(self, prefix: list[int]) -> None:
        if common_prefix(self.indexed, prefix) < len(self.indexed):
            self.reset()
        for i in range(len(self.indexed), len(prefix)):
            for n in range(self.min_n, self.max_n + 1):
                if i - n < 0:
                    break
                entry = self.index[n][tuple(prefix[i - n : i])].setdefault(prefix[i], [0, 0])
                entry[0] += 1
                entry[1] = i
        self.indexed = list(prefix)

    def lookup(self, context: list[int], k: int) -> Candidates:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            nxt = self.index[n].get(tuple(context[-n:]))
            if nxt:
                total = sum(c for c, _ in nxt.values())
                ranked = sorted(nxt.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:k]
                return [t for t, _ in ranked], [math.log(c / total) for _, (c, _) in ranked]
        return [], []

    def expand(self, prefix: list[int], reqs: list[ExpandRequest], k: int) -> list[Candidates]:
        self._index(prefix)
        return [self.lookup(list(prefix) + list(r.path_tokens), k) for r in reqs]

    def fed(self, nid: int) -> bool:
        return True


class NullDrafter(Drafter):
    """Proposes nothing: every round is one plain decoding step (the AR baseline)."""

    name = "none"

    def expand(self, prefix: list[int], reqs: list[ExpandRequest], k: int) -> list[Candidates]:
        return [([], []) for _ in reqs]
