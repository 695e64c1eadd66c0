"""The pre-draft cache (the early-exit paper §3 steps 4-6, Appendix A, Algorithm 1; docs/edge_agent.md,
"Pre-drafting").
Notes: docs/edge_agent.md, "edge_agent/predraft.py"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from edge_agent.draft_backends import ExpandRequest
from edge_agent.draft_session import DraftSession
from edge_agent.tree_builder import ROOT, TreeBuilder
from edge_agent.tree_session import Alignment
from specdec.protocol import EarlyFrame


@dataclass
class Entry:
    """A tree drafted for one guess of the round: (accepted node indices, next token)."""

    key: tuple[tuple[int, ...], int]
    confidence: float
    layer: int | None  # the exit layer that guessed it; None: the edge's own guess (:meth:`PreDraftCache.step`)
    path_ids: list[int]  # draft node ids of the accepted path (the sent tree's), root's child first
    path_tokens: list[int]
    root_id: int  # draft node id of the next token: the next tree's root
    builder: TreeBuilder
    done: bool = False

    @property
    def emitted(self) -> list[int]:
        return self.path_tokens + [self.key[1]]


@dataclass
class PreDraftStats:
    early_frames: int = 0
    entries: int = 0  # distinct guesses drafted for
    hits: int = 0  # rounds whose reply matched an entry (its tree sent at once)
    misses: int = 0  # rounds with early results or guesses, none matching the reply
    forwards: int = 0  # draft forwards spent on entries (and on feeding the leaves guesses need)
    layer_sum: int = 0  # exit layer of each early-result hit's entry
    early_hits: int = 0  # hits on early results (mean early-exit layer: layer_sum / early_hits)
    guessed: int = 0  # entries from the edge's own guesses


@dataclass
class PreDraftCache:
    """Entries of the round in flight, for one :class:`DraftSession`."""

    ds: DraftSession
    max_entries: int = 4
    stats: PreDraftStats = field(default_factory=PreDraftStats)

    def __post_init__(self):
        self.entries: dict[tuple, Entry] = {}
        self.prefix_len = -1  # the round in flight (its tree's prefix length)
        self.depth = 0  # forwards per entry: the sent tree's
        self._guess_nodes: int | None = None  # guesses still to make this round (begin_round)

    def begin_round(self, prefix_len: int, depth: int, guess_nodes: int | None = None) -> None:
        """A tree for ``prefix_len`` was just frozen and sent (``ds.sent`` is it). ``guess_nodes``:
        guess the round's outcomes here, assuming the server verifies that many nodes of the
        tree (the first :meth:`step` does it); None: wait for early results."""
        self.entries.clear()
        self.prefix_len, self.depth = prefix_len, max(1, depth)
        self._guess_nodes = guess_nodes

    # -- early results -----------------------------------------------------------------
    def offer(self, f: EarlyFrame) -> bool:
        """An early frame of the round in flight; True if it is a new guess worth drafting."""
        self.stats.early_frames += 1
        if f.prefix_len != self.prefix_len or self.ds.sent is None or not len(self.ds.sent[0]):
            return False  # a late frame of an earlier round, or a plain decoding step (no tree: no pre-draft)
        key = (tuple(f.accepted), int(f.token))
        if key in self.entries:
            e = self.entries[key]
            e.confidence = max(e.confidence, f.confidence)
            return False
        if len(self.entries) >= self.max_entries:
            return False
        tree, order = self.ds.sent
        if any(not 0 <= a < len(tree) for a in f.accepted):
            return False
        path = [order[a] for a in f.accepted]
        b = self.ds.builder
        if any(p not in b for p in path) or b.path(path[-1] if path else ROOT) != path:
            return False  # not a path of the sent tree
        self._add(key[0], key[1], f.confidence, f.layer, path)
        return True

    def pending(self) -> bool:
        return self._guess_nodes is not None or any(not e.done for e in self.entries.values())

    def _add(self, accepted: tuple[int, ...], token: int, confidence: float, layer: int | None,
             path: list[int]) -> None:
        """An entry for the outcome (``accepted`` tree indices, ``path`` their node ids; ``token``)."""
        b = self.ds.builder
        self.entries[(accepted, token)] = Entry((accepted, token), confidence, layer, path,
                                                [b.node(p).token for p in path], next(self.ds.ids),
                                                TreeBuilder(self.ds.config, self.ds.ids))
        self.stats.entries += 1

    # -- the edge's own guesses --------------------------------------------------------
    def _guess(self) -> None:
        """Entries for the round's likeliest outcomes by the draft's estimate (docs/edge_agent.md, "Pre-drafting");
        feeds the estimated-verified nodes left unfed first (one draft forward)."""
        k, self._guess_nodes = self._guess_nodes, None
        ds = self.ds
        if ds.sent is None or not len(ds.sent[0]) or not ds.builder.root.expanded:
            return
        b, (_, order) = ds.builder, ds.sent
        verified = order[: max(0, k)]
        unfed = [nid for nid in verified if not b.node(nid).expanded]
        if unfed and len(unfed) < self.room():
            self._feed_sent(unfed)
            self.stats.forwards += 1
        index, kept = {nid: i for i, nid in enumerate(order)}, set(verified)
        outcomes = []  # (probability, node, token)
        for v in [ROOT] + verified:
            n = b.node(v)
            if n.cands is None:
                continue
            continues = {b.node(c).token for c in n.children if c in kept}
            outcomes += [(math.exp(n.logp + lp), v, int(t)) for t, lp in zip(*n.cands) if int(t) not in continues]
        outcomes.sort(key=lambda o: -o[0])
        for p, v, t in outcomes[: self.max_entries]:
            path = b.path(v)
            self._add(tuple(index[x] for x in path), t, p, None, path)
            self.stats.guessed += 1

    # -- drafting ----------------------------------------------------------------------
    def _feed_sent(self, nids: list[int], extra: list[ExpandRequest] = ()) -> list:
        """One draft forward feeding nodes ``nids`` of the sent tree (their candidates are kept and
        their KV is live: the reply's path and proactive drafting read it) and ``extra`` requests;
        returns the candidates of ``extra``."""
        sent = self.ds.builder
        out = self.ds._forward([self.ds._request(nid) for nid in nids] + list(extra))
        for nid, cands in zip(nids, out):
            n = sent.node(nid)
            n.cands, n.expanded = cands, True
        return out[len(nids):]

    def room(self) -> int:
        """Draft nodes that can still be fed this round (the drafter's tree bits)."""
        return self.ds.drafter.room()

    def step(self) -> bool:
        """One draft forward for the most confident entry that is not done (the round's guesses
        first, when it still has to make them); False if none."""
        if self._guess_nodes is not None:
            self._guess()
            return True
        todo = sorted((e for e in self.entries.values() if not e.done), key=lambda e: -e.confidence)
        if not todo:
            return False
        e = todo[0]
        b, sent = e.builder, self.ds.builder
        if not sent.root.expanded:  # the draft KV is not at the prefix (nothing was drafted this round)
            e.done = True
            return True
        base = len(e.path_ids) + 1  # the entry root's depth below the current root
        if b.forwards == 0:  # feed the entry's root (and the path nodes the draft did not feed)
            unfed = [p for p in e.path_ids if not sent.node(p).expanded]
            if len(unfed) + 1 > self.room():
                e.done = True
                return True
            (toks, lps), = self._feed_sent(unfed, [ExpandRequest(e.root_id, e.key[1], base, tuple(e.path_ids),
                                                                 tuple(e.emitted))])
            b.expand_all([(ROOT, toks, lps)])
        else:
            front = [n for n in b.frontier() if n != ROOT][: max(0, self.room())]
            if not front:
                e.done = True
                return True
            reqs = []
            for nid in front:
                n = b.node(nid)
                reqs.append(ExpandRequest(nid, n.token, base + n.depth, tuple(e.path_ids + [e.root_id] + b.ancestors(nid)),
                                          tuple(e.emitted + b.path_tokens(nid))))
            out = self.ds._forward(reqs)
            b.expand_all([(nid, toks, lps) for nid, (toks, lps) in zip(front, out)])
        b.forwards += 1
        self.stats.forwards += 1
        if b.forwards >= self.depth:
            e.done = True
        return True

    # -- the reply ---------------------------------------------------------------------
    def take(self, accepted: list[int], bonus: int | None) -> Entry | None:
        """The entry the final reply confirms, or None (a miss when there were entries)."""
        hit = self.entries.get((tuple(accepted), bonus)) if bonus is not None else None
        if hit is not None and hit.builder.forwards == 0:
            hit = None  # nothing was drafted for it yet: no better than a miss
        if hit is not None:
            self.stats.hits += 1
            if hit.layer is not None:
                self.stats.early_hits += 1
                self.stats.layer_sum += hit.layer
        elif self.entries:
            self.stats.misses += 1
        self.entries.clear()
        self.prefix_len, self._guess_nodes = -1, None
        return hit

    def install(self, e: Entry) -> Alignment:
        """Make ``e``'s tree the draft session's next tree (after a hit); returns what that did to
        the proactive chain (dropped)."""
        ds = self.ds
        al = Alignment(bool(ds.chain), False, 0)
        new_prefix = ds.prefix + e.emitted
        live = [nid for nid, n in e.builder.nodes.items() if n.expanded]
        ds.drafter.advance(new_prefix, e.path_ids + [e.root_id], live)
        ds.prefix = new_prefix
        ds.builder = e.builder
        ds.sent, ds.chain = None, []
        return al
