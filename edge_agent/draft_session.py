"""Tree drafting with proactive continuation and reuse (SpecEdge §4.2).

A round: :meth:`DraftSession.draft`, :meth:`freeze`, :meth:`proactive_step` while the reply is away,
:meth:`on_reply`. A reused chain is token for token what a fresh draft from the new prefix gives.
Notes: docs/edge_agent.md, "edge_agent/draft_session.py"."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from edge_agent.draft_backends import Candidates, Drafter, ExpandRequest
from edge_agent.tree_builder import ROOT, TreeBuilder, TreeConfig
from edge_agent.tree_session import Alignment
from specdec import clock
from specdec.sampling import SamplingParams, sample_from_probs, target_probs
from specdec.tree import DraftTree


PREFILL_TOKENS = 16  # a forward that feeds more new prefix tokens than this is a prefill, not a draft level


def record_forward(session, t0: float) -> None:
    """A draft forward's time into ``session.forward_times`` (a level's cost, FlexSpec's T_marginal), unless it
    fed a prefill (the prompt, a re-open's history): that one would hold the depth policy at 1 for many rounds."""
    if len(session.prefix) - session.timed_upto <= PREFILL_TOKENS:
        session.forward_times.append(clock.perf_counter() - t0)
    session.timed_upto = len(session.prefix)


@dataclass
class _ProNode:
    id: int
    token: int
    depth: int  # depth below the current tree's root
    cands: Candidates | None = None  # set once fed


@dataclass
class DraftSession:
    """The ``match`` rule's trees (a :class:`~edge_agent.tree_session.TreeSession`): grown by
    cumulative log-prob, with a proactive chain below the best leaf while the reply is away."""

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
        self.timed_upto = 0  # prefix length at the last timed forward (record_forward)

    # -- setup -----------------------------------------------------------------------
    def start(self, prefix: list[int], config: TreeConfig | None = None) -> None:
        """Begin drafting after ``prefix`` (new generation or re-opened session)."""
        if config is not None:
            self.config = config
        self.prefix, self.timed_upto = list(prefix), 0
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
        t0 = clock.perf_counter()
        out = self.drafter.expand(self.prefix, reqs, self.config.topk)
        record_forward(self, t0)
        return out

    def step(self) -> bool:
        """One draft forward over the frontier; False when nothing can grow."""
        front = self.builder.frontier()
        if ROOT in front:
            front = [ROOT]  # nothing else exists below an unexpanded root
        else:  # a deep round can run out of the drafter's tree positions: the best nodes first
            front = front[: max(self.drafter.room(), 0)]
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

    @property
    def forwards(self) -> int:
        """Draft forwards that built the current tree (its depth in SpecEdge's sense)."""
        return self.builder.forwards

    def confidences(self, order: list[int]) -> list[int]:
        return self.builder.confidences(order)

    def proposals(self) -> None:
        return None  # sample-then-match trees carry no draft distributions

    # -- proactive -----------------------------------------------------------------------
    def proactive_step(self) -> bool:
        """Extend the chain below the best leaf by one token (at most one draft forward)."""
        if self.sent is None or len(self.chain) >= self.max_chain:
            return False
        if self.drafter.room() < 1:  # no tree position left to feed the next chain node
            self.max_chain = len(self.chain)
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
        tokens (accepted tokens + bonus + any the server ran ahead). Prepares the next tree."""
        tree, order = self.sent if self.sent is not None else (DraftTree.empty(), [])
        acc_ids = [order[i] for i in accepted]
        new_prefix = self.prefix + list(emitted)
        attempted = bool(self.chain)
        aligned = (attempted and bonus is not None and acc_ids == self.builder.path(self.leaf)
                   and bonus == self.chain[0].token and len(emitted) == len(acc_ids) + 1)
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


# -- chain drafts for rejection sampling ----------------------------------------------------
@dataclass
class _Link:
    id: int
    token: int
    q: torch.Tensor  # [vocab] the draft distribution the token was sampled from
    fed: bool = False  # its draft state is computed (the next link's q came from it)


class ChainDraftSession:
    """Chain drafting for split rejection sampling (Leviathan et al. 2023; DSSD §3): each token
    sampled from the draft's q (kept: q(x) goes uplink, q is the edge's half of a rejection's
    residual), proactive tokens reused only when every sent token and the bonus agree (SpecEdge
    §4.2). Why that stays exact: docs/edge_agent.md, "Chain drafting"."""

    def __init__(self, drafter: Drafter, vocab_size: int, params: SamplingParams,
                 generator: torch.Generator | None):
        self.drafter, self.vocab_size, self.generator = drafter, vocab_size, generator
        self.greedy = params.greedy
        self.q_params = SamplingParams(temperature=1.0) if params.greedy else params  # greedy: any q, argmax drafts
        self.ids = itertools.count()
        self.forward_times: list[float] = []
        self._reset([])

    def start(self, prefix: list[int]) -> None:
        """Begin drafting after ``prefix`` (the edge's whole history, owed token included)."""
        self._reset(prefix)
        self.drafter.advance(self.prefix, [], [])  # the draft KV keeps what it has of ``prefix``

    def _reset(self, prefix: list[int]) -> None:
        self.prefix, self.timed_upto = list(prefix), 0  # timed_upto: prefix length at the last timed forward
        self.chain: list[_Link] = []
        self.next_q: torch.Tensor | None = None  # the distribution after the chain's last token, once fed
        self.sent = 0
        self.dry = False  # the drafter proposes nothing after the chain: wait for the next prefix
        self.forwards = 0  # draft forwards of the current chain

    def _feed(self) -> torch.Tensor | None:
        """One draft forward: the distribution after the chain's last token (the root's when empty)."""
        if self.chain:
            last = self.chain[-1]
            req = ExpandRequest(last.id, last.token, len(self.chain), tuple(c.id for c in self.chain[:-1]),
                                tuple(c.token for c in self.chain))
        else:
            req = ExpandRequest(ROOT, self.prefix[-1], 0)
        t0 = clock.perf_counter()
        (lp,) = self.drafter.next_logits(self.prefix, [req], self.vocab_size)
        record_forward(self, t0)
        self.forwards += 1
        if self.chain:
            self.chain[-1].fed = True
        return None if lp is None else target_probs(lp, self.q_params)  # [vocab]

    def step(self) -> bool:
        """Add one token (at most one draft forward); False when the drafter has nothing."""
        if self.dry:
            return False
        if self.next_q is None:
            self.next_q = self._feed()
            if self.next_q is None:
                self.dry = True
                return False
        q, self.next_q = self.next_q, None
        x = int(torch.argmax(q)) if self.greedy else sample_from_probs(q, self.generator)
        self.chain.append(_Link(next(self.ids), x, q))
        return True

    def draft(self, depth: int) -> None:
        """Grow the chain to ``depth`` tokens (tokens carried over from proactive drafting count)."""
        while len(self.chain) < depth and self.step():
            pass

    def freeze(self, n: int) -> tuple[list[int], list[float]]:
        """Send the first ``n`` tokens: (tokens, q(token) of each)."""
        self.sent = n = min(n, len(self.chain))
        return [c.token for c in self.chain[:n]], [1.0 if self.greedy else min(1.0, float(c.q[c.token]))
                                                    for c in self.chain[:n]]

    def proactive_step(self, max_chain: int) -> bool:
        """Extend the chain past the sent tokens by one, up to ``max_chain`` proactive tokens."""
        return len(self.chain) - self.sent < max_chain and self.step()

    def q_at(self, i: int) -> torch.Tensor:
        """The draft distribution of sent token ``i`` (the residual's q when it is rejected)."""
        return self.chain[i].q

    def on_reply(self, num_accepted: int, last: int | None) -> Alignment:
        """Apply a verification: ``num_accepted`` sent tokens and then ``last`` (the bonus, or
        the resampled token; None while the edge is still sampling the residual)."""
        emitted = [c.token for c in self.chain[:num_accepted]] + ([last] if last is not None else [])
        attempted = len(self.chain) > self.sent
        aligned = (attempted and last is not None and num_accepted == self.sent
                   and self.chain[self.sent].token == last)
        keep = self.chain[: self.sent + 1] if aligned else self.chain[:num_accepted]
        seed = self.chain[self.sent + 1:] if aligned else []
        path = list(itertools.takewhile(lambda c: c.fed, keep))
        if len(path) < len(keep):  # the reused chain needs all of the accepted path in the draft KV
            seed = []
        self.drafter.advance(self.prefix + emitted, [c.id for c in path], [c.id for c in seed if c.fed])
        self.prefix += emitted
        if not seed and not (aligned and len(path) == len(keep)):
            self.next_q = None  # it was the distribution after a dropped token
        self.chain, self.sent, self.dry, self.forwards = seed, 0, False, 0
        return Alignment(attempted, aligned, len(seed))
