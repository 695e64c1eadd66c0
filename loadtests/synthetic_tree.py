"""Synthetic draft trees whose acceptance follows a configurable model.

A simulated edge user has no draft model, yet the server must do real target forwards
on real trees and accept what the target really agrees with. The load test therefore
knows the target's greedy continuation of every prompt (computed once by a local copy
of the target, :mod:`loadtests.workload`) and drafts from it with per-node corruption,
like a draft model of known quality would (SpecEdge §4.2 trees, SpecExec-style shape):

- level ``i`` of the tree has a *primary* candidate (the draft's top-1) that equals the
  target's next token with probability ``alpha``; when it does not, a *secondary*
  candidate (the draft's top-2, a sibling) is correct with probability ``sibling_alpha``;
- the chain continues under the correct candidate; once a level has none, drafting goes on
  under the wrong primary (a real drafter does not know it is wrong), and none of it can be
  accepted;
- the rest of the node budget is side branches of deliberately wrong tokens.

So each level is hit with probability ``p = alpha + (1 - alpha) * sibling_alpha``,
independently, and the expected number of accepted nodes of a depth-``D`` tree is
``sum_{i=1..D} p^i`` (:func:`expected_accepted`); the report compares it with what the
server actually accepted. Pure module: no torch, no gevent, no Ray.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class AcceptanceModel:
    alpha: float = 0.7  # P(draft top-1 == target token) per level
    sibling_alpha: float = 0.3  # P(top-2 sibling == target token | top-1 wrong)

    def __post_init__(self):
        for name in ("alpha", "sibling_alpha"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")

    @property
    def level_hit(self) -> float:
        """Probability that a level of the tree holds the target's token."""
        return self.alpha + (1.0 - self.alpha) * self.sibling_alpha


def expected_accepted(model: AcceptanceModel, depth: int, truth_left: int | None = None,
                      budget: int | None = None) -> float:
    """E[accepted nodes] of one tree of ``depth`` levels: ``sum_{i=1..D} p^i``.

    With a node ``budget``, a second guess needs a spare node (``budget - depth`` of them),
    so levels past the spare nodes hit with ``alpha`` alone; computed exactly over the
    number of spare nodes used so far.
    """
    d = depth if truth_left is None else min(depth, truth_left)
    if budget is None:
        p = model.level_hit
        return sum(p ** i for i in range(1, d + 1))
    d = min(d, budget)
    spare = budget - min(depth, budget)
    a, s = model.alpha, model.sibling_alpha
    dist = {spare: 1.0}  # spare nodes left -> P(still on the target's path)
    total = 0.0
    for _ in range(d):
        nxt: dict[int, float] = {}
        for left, pr in dist.items():
            nxt[left] = nxt.get(left, 0.0) + pr * a
            if left > 0:
                nxt[left - 1] = nxt.get(left - 1, 0.0) + pr * (1 - a) * s
        dist = nxt
        total += sum(dist.values())
    return total


def _wrong(truth_tok: int | None, vocab: int, rng: random.Random, low: int) -> int:
    """A token id in [low, vocab) that differs from ``truth_tok``."""
    while True:
        t = rng.randrange(low, vocab)
        if t != truth_tok:
            return t


def synthetic_tree(truth: list[int], model: AcceptanceModel, depth: int, budget: int, vocab: int,
                   rng: random.Random, low_token: int = 3) -> tuple[list[int], list[int], int]:
    """Draft a tree for the target continuation ``truth`` (the tokens after the root).

    Returns ``(tokens, parents, hits)``: the tree in parents-first order and the number of
    levels the model made correct (the accepted length the server should report, when the
    server's greedy continuation equals ``truth``). ``budget`` bounds the node count;
    ``depth`` the number of levels (draft forwards). Wrong tokens avoid ids below
    ``low_token`` (special tokens such as EOS) so a wrong draft never stops a session.
    """
    depth = max(0, min(depth, budget))
    tokens: list[int] = []
    parents: list[int] = []
    parent = -1
    on_truth = True
    hits = 0
    spare = budget - depth  # nodes left for secondary candidates and side branches
    for level in range(depth):
        t = truth[level] if level < len(truth) else None
        if on_truth and t is not None and rng.random() < model.alpha:
            tokens.append(t)
            parents.append(parent)
            parent = len(tokens) - 1
            hits += 1
            continue
        primary = _wrong(t, vocab, rng, low_token)
        tokens.append(primary)
        parents.append(parent)
        primary_idx = len(tokens) - 1
        if on_truth and t is not None and spare > 0 and rng.random() < model.sibling_alpha:
            tokens.append(t)  # the draft's second guess was right: the chain goes on under it
            parents.append(parent)
            spare -= 1
            parent = len(tokens) - 1
            hits += 1
            continue
        on_truth = False
        parent = primary_idx
    chain = list(range(len(tokens)))
    truth_at = {}  # node index -> the target token a sibling of it must not equal
    for i in chain:
        d = 0
        p = i
        while p >= 0:
            d += 1
            p = parents[p]
        truth_at[i] = truth[d - 1] if d - 1 < len(truth) else None
    while spare > 0 and chain:
        # side branch: a wrong sibling of a random chain node (same parent, different token)
        i = rng.choice(chain)
        tokens.append(_wrong(truth_at[i], vocab, rng, low_token))
        parents.append(parents[i])
        spare -= 1
    return tokens, parents, hits
