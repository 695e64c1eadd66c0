"""Tree drafting with proactive continuation and reuse (SpecEdge §4.2).

One :class:`DraftSession` per generation. A round is:

1. :meth:`DraftSession.draft` — ``depth`` draft forwards grow the current tree
   (:class:`~edge_agent.tree_builder.TreeBuilder`); :meth:`freeze` turns it into the
   wire tree.
2. While the verify request is in flight, :meth:`proactive_step` keeps drafting from
   the single leaf with the highest cumulative log-prob: a greedy chain ``P1, P2, ...``
   below that leaf, one draft forward per step (SpecEdge: one expansion head beats many,
   Eq. 1).
3. :meth:`on_reply` applies the server's accepted path and bonus token. *Complete
   draft alignment*: the accepted path is exactly the path to that leaf and the bonus
   equals ``P1``. Then ``P1`` becomes the new root, its KV is kept, and the chain
   ``P2..Pm`` (with the draft KV of the fed ones and the top-k candidates seen at each)
   seeds the next tree, which therefore starts that many levels deeper. Otherwise the
   proactive work is dropped and the next tree starts at the verified end.

The reused chain is, token for token, the greedy chain a fresh draft would produce from
the new prefix: the draft model is a function of the token path, and the chain was
computed with exactly that path in its KV mask.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from deploy.verifier.tree import DraftTree
from edge_agent.drafter import Candidates, Drafter, ExpandRequest
from edge_agent.tree_builder import ROOT, TreeBuilder, TreeConfig


@dataclass
class _ProNode:
    id: int
    token: int
    depth: int  # depth below the current tree's root
    cands: Candidates | None = None  # set once fed


@dataclass
class Alignment:
    """What the reply did to the proactive chain."""

    attempted: bool  # a proactive token existed when the reply came
    aligned: bool  # complete draft alignment
    reused: int  # proactive tokens carried into the next tree


@dataclass
class DraftSession:
    drafter: Drafter
    config: TreeConfig = field(default_factory=TreeConfig)
    forward_times: list[float] = field(default_factory=list)  # seconds per draft forward

    def __post_init__(self):
        self.ids = itertools.count()
        self.prefix: list[int] = []
        self.builder = TreeBuilder(self.config, self.ids)
        self.sent: tuple[DraftTree, list[int]] | None = None
        self.leaf = ROOT
        self.chain: list[_ProNode] = []  # P1..Pm below the leaf
        self.max_chain = 0

    # -- setup -----------------------------------------------------------------------
    def start(self, prefix: list[int], config: TreeConfig | None = None) -> None:
        """Begin drafting after ``prefix`` (new generation or re-opened session)."""
        if config is not None:
            self.config = config
        self.prefix = list(prefix)
        self.drafter.advance(self.prefix, [], [])
        self.builder = TreeBuilder(self.config, self.ids)
        self.sent, self.chain = None, []

    def set_config(self, config: TreeConfig) -> None:
        """Budget/top-k/depth limits for the next growth (the tree keeps its nodes)."""
        self.config = config
        self.builder.config = config

    # -- drafting --------------------------------------------------------------------
    def _request(self, nid: int) -> ExpandRequest:
        if nid == ROOT:
            return ExpandRequest(ROOT, self.prefix[-1], 0)
        n = self.builder.node(nid)
        anc = self.builder.ancestors(nid)
        return ExpandRequest(nid, n.token, n.depth, tuple(anc), tuple(self.builder.path_tokens(nid)))

    def _forward(self, reqs: list[ExpandRequest]) -> list[Candidates]:
        t0 = time.perf_counter()
        out = self.drafter.expand(self.prefix, reqs, self.config.topk)
        self.forward_times.append(time.perf_counter() - t0)
        return out

    def step(self) -> bool:
        """One draft forward over the frontier; False when nothing can grow."""
        front = self.builder.frontier()
        if ROOT in front:
            front = [ROOT]  # nothing else exists below an unexpanded root
        if not front:
            return False
        results = self._forward([self._request(n) for n in front])
        self.builder.expand_all([(nid, toks, lps) for nid, (toks, lps) in zip(front, results)])
        self.builder.forwards += 1
        return True

    def draft(self, depth: int) -> int:
        """Run up to ``depth`` draft forwards; returns how many ran."""
        n = 0
        while n < depth and self.step():
            n += 1
        return n

    def freeze(self, max_chain: int = 0) -> tuple[DraftTree, list[int]]:
        """The tree to send; prepares a proactive chain of at most ``max_chain`` tokens."""
        self.sent = self.builder.to_tree()
        self.leaf = self.builder.best_leaf()
        self.chain = []
        # the chain P2..Pm becomes levels 1..m-1 of the next tree
        self.max_chain = max(0, min(max_chain, self.config.max_depth + 1))
        return self.sent

    # -- proactive -----------------------------------------------------------------------
    def proactive_step(self) -> bool:
        """Extend the chain below the best leaf by one token (at most one draft forward)."""
        if self.sent is None or len(self.chain) >= self.max_chain:
            return False
        if not self.chain:
            leaf = self.builder.node(self.leaf)
            cands = leaf.cands
            if cands is None:  # the leaf itself is fed now
                cands = self._forward([self._request(self.leaf)])[0]
                leaf.cands = cands
                leaf.expanded = True
            parent_depth = leaf.depth
        else:
            last = self.chain[-1]
            anc = self.builder.path(self.leaf) + [p.id for p in self.chain[:-1]]
            path_tokens = self.builder.path_tokens(self.leaf) + [p.token for p in self.chain]
            last.cands = cands = self._forward(
                [ExpandRequest(last.id, last.token, last.depth, tuple(anc), tuple(path_tokens))])[0]
            parent_depth = last.depth
        if not cands[0]:
            self.max_chain = len(self.chain)  # the drafter has nothing to propose
            return False
        self.chain.append(_ProNode(next(self.ids), int(cands[0][0]), parent_depth + 1))
        return True

    # -- reply ---------------------------------------------------------------------------
    def _fed(self, nid: int) -> bool:
        return nid in self.builder and self.builder.node(nid).expanded

    def on_reply(self, accepted: list[int], bonus: int | None, emitted: list[int]) -> Alignment:
        """Apply a verification: ``accepted`` tree indices, ``bonus`` token, ``emitted``
        tokens (accepted tokens + bonus). Prepares the next tree."""
        tree, order = self.sent if self.sent is not None else (DraftTree.empty(), [])
        acc_ids = [order[i] for i in accepted]
        new_prefix = self.prefix + list(emitted)
        attempted = bool(self.chain)
        aligned = (attempted and bonus is not None and acc_ids == self.builder.path(self.leaf)
                   and bonus == self.chain[0].token)
        path_ids: list[int] = []
        for nid in acc_ids:  # the fed prefix of the accepted path keeps its draft KV
            if not self._fed(nid):
                break
            path_ids.append(nid)
        seed: list[_ProNode] = []
        if aligned and len(path_ids) == len(acc_ids) and self.chain[0].cands is not None:
            path_ids.append(self.chain[0].id)  # P1 is the new root and was fed
            seed = [p for p in self.chain[1:]]
        live = [p.id for p in seed if p.cands is not None]
        self.drafter.advance(new_prefix, path_ids, live)
        self.prefix = new_prefix
        self.builder = TreeBuilder(self.config, self.ids)
        if aligned and self.chain[0].cands is not None:
            self._seed(self.chain[0].cands, seed)
        self.sent, self.chain = None, []
        return Alignment(attempted, aligned, len(seed))

    def _seed(self, root_cands: Candidates, chain: list[_ProNode]) -> None:
        """Replay the proactive expansions into the fresh tree (no draft forward).

        The root (P1) gets the candidates seen when P1 was fed; each fed chain node gets
        its own; chain nodes keep their ids (their draft KV is live under those ids).
        """
        parent, cands = ROOT, root_cands
        for p in chain + [None]:
            toks, lps = cands
            ids = [p.id if p is not None and t == p.token else next(self.ids) for t in toks[: self.config.topk]]
            self.builder.expand(parent, toks[: self.config.topk], lps[: self.config.topk], ids=ids)
            if p is None or p.id not in self.builder or p.cands is None:
                break
            parent, cands = p.id, p.cands
