"""Sampled draft trees for tree rejection sampling (issue 17; multi-draft speculative sampling,
SpecInfer §4.2 / SpecTr, siblings without replacement as in Recursive Speculative Decoding and
Sequoia §3.2; split edge/cloud as DSSD §3 and PicoSpec §3.3 split chains).
Notes: docs/edge_agent.md, "edge_agent/sampled_tree.py"."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from edge_agent.draft_backends import Drafter, ExpandRequest
from edge_agent.draft_session import record_forward
from edge_agent.tree_builder import ROOT, TreeConfig
from edge_agent.tree_session import Alignment
from specdec import clock
from specdec.proposal import Proposal, draw_without_replacement, make_proposal
from specdec.sampling import SamplingParams, target_probs
from specdec.tree import DraftTree

PRIOR_RATES = (0.5, 0.15, 0.08, 0.05, 0.03, 0.02, 0.02, 0.02)  # a_i before measurements (i-th sibling)
RATE_EMA = 0.05  # weight of one observation in a_i
Q_ENTRIES = 16  # proposal entries per expanded node (uplink: 6 bytes each)


def plan_shape(budget: int, depth: int, max_children: int, max_expand: int, rates: list[float]) -> list[int]:
    """The planned tree, parents-first in level order (siblings by index): each entry is its
    parent's plan index (-1: the root). Best-first over slots scored score(parent) * a_i."""
    if budget <= 0 or depth <= 0:
        return []
    nodes: list[tuple[int, int, int, float]] = []  # (parent, depth, sibling index, score)
    internal: dict[int, int] = {}  # level -> expanded nodes at that level
    tie = itertools.count()
    heap = [(-rates[0], next(tie), -1, 0, 1, 1.0)]  # (-score, tie, parent, sibling, depth, parent score)
    while heap and len(nodes) < budget:
        neg, _, parent, sib, d, ps = heapq.heappop(heap)
        if sib == 0:  # the parent becomes an expanded node of its level
            lvl = d - 1
            if internal.get(lvl, 0) >= max_expand:
                continue
            internal[lvl] = internal.get(lvl, 0) + 1
        idx = len(nodes)
        nodes.append((parent, d, sib, -neg))
        if sib + 1 < min(max_children, len(rates)):
            heapq.heappush(heap, (-ps * rates[sib + 1], next(tie), parent, sib + 1, d, ps))
        if d < depth:
            heapq.heappush(heap, (neg * rates[0], next(tie), idx, 0, d + 1, -neg))  # score * a_1
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i][1], _lineage(nodes, i)))
    index = {old: new for new, old in enumerate(order)}
    return [-1 if nodes[i][0] < 0 else index[nodes[i][0]] for i in order]


def _lineage(nodes, i: int) -> tuple[int, ...]:
    """Sibling indices from the root down to node ``i``: sorts a level by parent, then sibling."""
    out = []
    while i >= 0:
        out.append(nodes[i][2])
        i = nodes[i][0]
    return tuple(reversed(out))


@dataclass
class _Node:
    id: int
    token: int
    parent: int  # index in the session's node list, -1 for the root
    depth: int
    plan: int  # index in the planned shape
    fed: bool = False


@dataclass
class SampledTreeSession:
    """One generation's sampled trees (a :class:`~edge_agent.tree_session.TreeSession`):
    :meth:`draft` builds a tree, :meth:`freeze` sends it with :meth:`proposals`, :meth:`on_reply`
    applies the server's walk and learns the rates."""

    drafter: Drafter
    vocab_size: int
    params: SamplingParams
    generator: torch.Generator | None
    config: TreeConfig = field(default_factory=TreeConfig)
    q_entries: int = Q_ENTRIES
    forward_times: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.ids = itertools.count()
        self.rates = list(PRIOR_RATES)
        self.prefix: list[int] = []
        self.timed_upto = 0  # prefix length at the last timed forward (record_forward)
        self._reset()

    def _reset(self) -> None:
        self.nodes: list[_Node] = []
        self.props: dict[int, Proposal] = {}  # position (-1 = root, else node index) -> proposal
        self.forwards = 0

    # -- the rest of edge_agent.tree_session.TreeSession -----------------------------------
    def start(self, prefix: list[int], config: TreeConfig | None = None) -> None:
        if config is not None:
            self.config = config
        self.prefix, self.timed_upto = list(prefix), 0
        self.drafter.advance(self.prefix, [], [])
        self._reset()

    def set_config(self, config: TreeConfig) -> None:
        self.config = config

    def confidences(self, order: list[int]) -> None:
        return None  # the server never truncates these trees: no confidence bytes

    def proactive_step(self) -> bool:
        return False

    def draft(self, depth: int) -> int:
        """Plan the shape for ``depth`` draft forwards and draw it, one forward per level."""
        self._reset()
        cfg = self.config
        plan = plan_shape(cfg.budget, min(depth, cfg.max_depth), cfg.topk, cfg.max_expand, self.rates)
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(plan):
            kids.setdefault(p, []).append(i)
        level: list[tuple[int, int]] = [(-1, -1)]  # (node index or -1, plan index or -1) to feed
        while level and any(kids.get(pl) for _, pl in level):
            feed = [(n, pl) for n, pl in level if kids.get(pl)]
            reqs = [self._request(n) for n, _ in feed]
            t0 = clock.perf_counter()
            rows = self.drafter.next_logits(self.prefix, reqs, self.vocab_size)
            record_forward(self, t0)
            self.forwards += 1
            level = []
            for (n, pl), lp in zip(feed, rows):
                if n >= 0:
                    self.nodes[n].fed = True
                if lp is None:
                    continue
                prop = make_proposal(target_probs(lp, self.params), self.q_entries)
                drawn = draw_without_replacement(prop, len(kids[pl]), self.generator)
                if drawn:
                    self.props[n] = prop
                for tok, child_plan in zip(drawn, kids[pl]):
                    parent_depth = self.nodes[n].depth if n >= 0 else 0
                    self.nodes.append(_Node(next(self.ids), tok, n, parent_depth + 1, child_plan))
                    level.append((len(self.nodes) - 1, child_plan))
        return self.forwards

    def _request(self, n: int) -> ExpandRequest:
        if n < 0:
            return ExpandRequest(ROOT, self.prefix[-1], 0)
        path = self._path(n)
        return ExpandRequest(self.nodes[n].id, self.nodes[n].token, self.nodes[n].depth,
                             tuple(self.nodes[j].id for j in path[:-1]), tuple(self.nodes[j].token for j in path))

    def _path(self, n: int) -> list[int]:
        out = []
        while n >= 0:
            out.append(n)
            n = self.nodes[n].parent
        return out[::-1]

    def freeze(self, max_chain: int = 0) -> tuple[DraftTree, list[int]]:
        """The wire tree: nodes in drawing order (level by level, siblings as drawn)."""
        tree = DraftTree(tuple(n.token for n in self.nodes), tuple(n.parent for n in self.nodes))
        return tree, [n.id for n in self.nodes]

    def proposals(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per position (root, then node i): the proposal its children were drawn from."""
        return [(p.ids, p.weights) if (p := self.props.get(i)) else ((), ()) for i in range(-1, len(self.nodes))]

    def on_reply(self, accepted: list[int], bonus: int | None, emitted: list[int]) -> Alignment:
        """Apply the server's walk: learn the sibling rates, keep the fed accepted path's draft KV."""
        self._observe(accepted, bonus)
        path = []
        for a in accepted:
            if not self.nodes[a].fed:
                break
            path.append(self.nodes[a].id)
        self.prefix = self.prefix + list(emitted)
        self.drafter.advance(self.prefix, path, [])
        self._reset()
        return Alignment(False, False, 0)

    def _observe(self, accepted: list[int], bonus: int | None) -> None:
        """a_i <- EMA of "the i-th sibling was accepted when reached" along the walk."""
        pos = -1
        for step in list(accepted) + [None]:
            kids = [i for i, n in enumerate(self.nodes) if n.parent == pos]
            if not kids:
                break
            j = kids.index(step) if step is not None else next(
                (k for k, c in enumerate(kids) if self.nodes[c].token == bonus), None)  # a stop ends a walk early
            for i in range(len(kids) if j is None else j + 1):
                if i < len(self.rates):
                    hit = 1.0 if i == j else 0.0
                    self.rates[i] += RATE_EMA * (hit - self.rates[i])
            if step is None:
                break
            pos = step
        self.rates = [max(r, 1e-3) for r in self.rates]
