"""Tree rejection sampling's proposals: the sparse distribution a node's children are drawn from (SpecInfer §4.2 /
SpecTr, Sequoia §3.2), integer weights so edge and server hold the very same q. docs/specdec.md, docs/acceptance.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import sample_from_probs
from specdec.tree import DraftTree

Q_WEIGHT_MAX = 65535  # proposal weights are u16 on the wire


@dataclass(frozen=True)
class Proposal:
    """The distribution an edge drew one node's children from: q(x) = w_x / sum(w) on ``ids`` (integer w)."""

    ids: tuple[int, ...]
    weights: tuple[int, ...]

    def dense(self, vocab: int) -> torch.Tensor:
        """q as a [vocab] float64 distribution."""
        q = torch.zeros(vocab, dtype=torch.float64)  # [vocab]
        q[list(self.ids)] = torch.tensor(self.weights, dtype=torch.float64)
        return q / q.sum()


def make_proposal(
    q: torch.Tensor,  # [vocab] the draft's processed distribution at the node
    max_entries: int,
    mass: float = 0.999,
) -> Proposal:
    """The sparse proposal the edge draws a node's children from: q's largest entries, the fewest holding
    ``mass`` (at most ``max_entries``), as u16 weights. Any proposal is exact (docs/specdec.md)."""
    vals, ids = torch.sort(q.double(), descending=True)
    n = int(torch.searchsorted(torch.cumsum(vals, 0), torch.tensor([mass * float(vals.sum())],
                                                                     dtype=torch.float64)).item()) + 1
    n = max(1, min(n, max_entries, int((vals > 0).sum())))
    w = torch.round(vals[:n] / vals[0] * Q_WEIGHT_MAX).long()  # [n]
    keep = w > 0
    return Proposal(tuple(ids[:n][keep].tolist()), tuple(w[keep].tolist()))


def draw_without_replacement(proposal: Proposal, m: int, generator: torch.Generator | None) -> list[int]:
    """``m`` children drawn one after another without replacement (at most the support), in drawing order."""
    w = torch.tensor(proposal.weights, dtype=torch.float64)  # [support]
    out = []
    for _ in range(min(m, len(proposal.ids))):
        j = sample_from_probs(w, generator)
        out.append(proposal.ids[j])
        w[j] = 0.0
    return out


def check_proposals(tree: DraftTree, proposals, vocab: int) -> tuple[Proposal | None, ...]:
    """Validate the wire's (ids, weights) per position (root, then node i) against ``tree``: a position with
    children needs one holding every child (distinct, weight >= 1), a leaf none. Raises ValueError."""
    if len(proposals) != len(tree) + 1:
        raise ValueError(f"{len(proposals)} proposals for a tree of {len(tree)} nodes (need one per node + root)")
    out: list[Proposal | None] = []
    for pos, (kids, prop) in enumerate(zip(tree.children, proposals)):
        ids, weights = (tuple(int(x) for x in prop[0]), tuple(int(w) for w in prop[1])) if prop else ((), ())
        if not kids:
            if ids:
                raise ValueError(f"position {pos} has no children but carries a proposal")
            out.append(None)
            continue
        if len(ids) != len(weights) or len(set(ids)) != len(ids):
            raise ValueError(f"position {pos}: proposal ids must be distinct, one weight each")
        if any(not (0 <= x < vocab) for x in ids) or any(w <= 0 for w in weights):
            raise ValueError(f"position {pos}: proposal ids must be in the vocabulary and weights >= 1")
        toks = [tree.tokens[c] for c in kids]
        if len(set(toks)) != len(toks) or not set(toks) <= set(ids):
            raise ValueError(f"position {pos}: children must be distinct tokens drawn from its proposal")
        out.append(Proposal(ids, weights))
    return tuple(out)
