"""Draft-tree construction by cumulative log-probability (SpecExec / Sequoia style; SpecEdge §4.2).

Pure Python (the caller runs the draft). Invariant: every kept node's parent is kept.
Notes: docs/edge_agent.md, "edge_agent/tree_builder.py"."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from specdec.tree import DraftTree
from specdec.truncation import encode_confidence

ROOT = -1  # the root: the last verified token (prefix[-1])


@dataclass
class Node:
    id: int
    token: int
    parent: int  # node id, or ROOT
    depth: int  # 1 for children of the root
    logp: float  # cumulative draft log-probability from the root
    expanded: bool = False
    children: list[int] = field(default_factory=list)
    cands: tuple[list[int], list[float]] | None = None  # the draft's top-k at this node, once fed


@dataclass(frozen=True)
class TreeConfig:
    budget: int = 32  # nodes kept (the root not counted)
    topk: int = 4  # children proposed per expanded node
    max_expand: int = 8  # nodes fed per draft forward
    max_depth: int = 32  # deepest node allowed (the server's max_tree_depth)

    @classmethod
    def chain(cls, budget: int = 32, max_depth: int = 32) -> "TreeConfig":
        return cls(budget=budget, topk=1, max_expand=1, max_depth=max_depth)


class TreeBuilder:
    """One draft tree below a root; grows by :meth:`expand`, pruned to ``config.budget``."""

    def __init__(self, config: TreeConfig, ids: itertools.count | None = None):
        self.config = config
        self.ids = ids if ids is not None else itertools.count()
        self.nodes: dict[int, Node] = {}  # kept nodes only
        self.root = Node(ROOT, -1, ROOT, 0, 0.0)
        self.forwards = 0  # draft forwards spent on this tree (depth in SpecEdge's sense)

    # -- queries -------------------------------------------------------------------
    def node(self, nid: int) -> Node:
        return self.root if nid == ROOT else self.nodes[nid]

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, nid: int) -> bool:
        return nid == ROOT or nid in self.nodes

    def ancestors(self, nid: int) -> list[int]:
        """Ids from the root's child down to ``nid``'s parent (ROOT excluded)."""
        out = []
        nid = self.node(nid).parent if nid != ROOT else ROOT
        while nid != ROOT:
            out.append(nid)
            nid = self.nodes[nid].parent
        return out[::-1]

    def path(self, nid: int) -> list[int]:
        """Ids from the root's child down to ``nid`` inclusive ([] for ROOT)."""
        return [] if nid == ROOT else self.ancestors(nid) + [nid]

    def path_tokens(self, nid: int) -> list[int]:
        return [self.nodes[i].token for i in self.path(nid)]

    def _rank(self, n: Node) -> tuple[float, int]:
        return (-n.logp, n.id)

    def _full(self) -> bool:
        return len(self.nodes) >= self.config.budget

    def _worst(self) -> Node | None:
        return max(self.nodes.values(), key=self._rank) if self.nodes else None

    def frontier(self) -> list[int]:
        """Unexpanded nodes worth one draft forward, best first (at most ``max_expand``).

        A node is skipped when it cannot add a kept child: at ``max_depth``, or when the
        tree is full and the node does not beat the worst kept node (its children rank
        below it).
        """
        cand = [n for n in ([self.root] + list(self.nodes.values()))
                if not n.expanded and n.depth < self.config.max_depth]
        if self._full():
            worst = self._worst()
            cand = [n for n in cand if self._rank(n) < self._rank(worst)]
        cand.sort(key=self._rank)
        return [n.id for n in cand[: self.config.max_expand]]

    # -- growth --------------------------------------------------------------------
    def expand(self, nid: int, tokens: list[int], logprobs: list[float],
               ids: list[int] | None = None) -> list[int]:
        """Record one draft forward's result for node ``nid``: its top-k children.

        ``logprobs`` are the draft's log-probabilities of ``tokens`` at ``nid`` (not
        cumulative). ``ids`` reuses given node ids (proactive nodes carried over).
        Returns the ids of the new children that survived pruning.
        """
        return self.expand_all([(nid, tokens, logprobs, ids)])

    def expand_all(self, results) -> list[int]:
        """Several expansions of one draft forward: all children compete, then one prune.

        ``results``: ``(nid, tokens, logprobs[, ids])`` tuples.
        """
        new: list[int] = []
        for r in results:
            nid, tokens, logprobs = r[0], r[1], r[2]
            ids = r[3] if len(r) > 3 else None
            if nid not in self:
                continue
            new += self._add(nid, tokens, logprobs, ids)
        self._prune()
        return [c for c in new if c in self.nodes]

    def _add(self, nid: int, tokens: list[int], logprobs: list[float], ids: list[int] | None) -> list[int]:
        parent = self.node(nid)
        parent.expanded = True
        parent.cands = (list(tokens), list(logprobs))
        new = []
        for j, (tok, lp) in enumerate(list(zip(tokens, logprobs))[: self.config.topk]):
            if parent.depth + 1 > self.config.max_depth:
                break
            if any(self.nodes[c].token == tok for c in parent.children if c in self.nodes):
                continue  # duplicate proposal (n-gram drafters may repeat)
            lp = min(float(lp), 0.0)
            if math.isnan(lp):
                continue
            cid = ids[j] if ids is not None else next(self.ids)
            child = Node(cid, int(tok), nid, parent.depth + 1, parent.logp + lp)
            self.nodes[cid] = child
            parent.children.append(cid)
            new.append(cid)
        return new

    def _prune(self) -> None:
        if len(self.nodes) <= self.config.budget:
            return
        ranked = sorted(self.nodes.values(), key=self._rank)
        for n in ranked[self.config.budget:]:
            del self.nodes[n.id]
        for n in [self.root] + list(self.nodes.values()):
            n.children = [c for c in n.children if c in self.nodes]

    # -- output --------------------------------------------------------------------
    def to_tree(self) -> tuple[DraftTree, list[int]]:
        """The wire tree in priority order (best cumulative log-prob first; a parent ranks
        before its children, see the module docstring, so every prefix is a tree and the
        server may verify only a prefix) and the node id of each tree index."""
        order = sorted(self.nodes, key=lambda nid: self._rank(self.nodes[nid]))
        index = {nid: i for i, nid in enumerate(order)}
        tokens = tuple(self.nodes[n].token for n in order)
        parents = tuple(-1 if self.nodes[n].parent == ROOT else index[self.nodes[n].parent] for n in order)
        return DraftTree(tokens, parents), order

    def confidences(self, order: list[int]) -> list[int]:
        """One byte per node of ``order``: its cumulative draft log-prob (the wire's ``conf``)."""
        return [encode_confidence(self.nodes[n].logp) for n in order]

    def best_leaf(self) -> int:
        """The leaf with the highest cumulative log-prob (ROOT for an empty tree)."""
        leaves = [n for n in self.nodes.values() if not n.children]
        return min(leaves, key=self._rank).id if leaves else ROOT
