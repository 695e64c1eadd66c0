"""Proposals of tree rejection sampling: built by the edge, checked by the server."""

from __future__ import annotations

import pytest
import torch

from specdec import proposal
from specdec.proposal import check_proposals, draw_without_replacement, make_proposal
from specdec.tree import DraftTree

V = 5


def test_proposals_are_checked_against_the_tree():
    tree = DraftTree((1, 2, 3), (-1, -1, 0))
    good = [((1, 2, 4), (9, 5, 1)), ((3,), (7,)), None, None]
    assert [p.ids if p else None for p in check_proposals(tree, good, V)] == [(1, 2, 4), (3,), None, None]
    for bad in ([((1,), (9,)), ((3,), (7,)), None, None],  # child 2 not in the proposal
                [((1, 2), (9, 0)), ((3,), (7,)), None, None],  # zero weight
                [((1, 2), (9, 5)), ((3,), (7,)), ((0,), (1,)), None],  # a leaf with a proposal
                [((1, 2), (9, 5)), ((3,), (7,)), None],  # one short
                [((1, 1, 2), (9, 9, 5)), ((3,), (7,)), None, None]):  # duplicate ids
        with pytest.raises(ValueError):
            check_proposals(tree, bad, V)
    with pytest.raises(ValueError):  # duplicate sibling tokens cannot be drawn without replacement
        check_proposals(DraftTree((1, 1), (-1, -1)), [((1, 2), (3, 3)), None, None], V)


def test_proposal_keeps_the_largest_entries_and_draws_without_replacement():
    q = torch.tensor([0.05, 0.5, 0.3, 0.1, 0.05])
    prop = make_proposal(q, 3)
    assert prop.ids == (1, 2, 3) and prop.weights[0] == proposal.Q_WEIGHT_MAX
    assert make_proposal(q, 5, mass=0.85).ids == (1, 2, 3)  # the fewest entries holding the mass
    g = torch.Generator().manual_seed(0)
    draws = [tuple(draw_without_replacement(prop, 3, g)) for _ in range(3000)]
    assert all(sorted(d) == [1, 2, 3] for d in draws)
    firsts = {t: sum(d[0] == t for d in draws) / 3000 for t in (1, 2, 3)}
    assert abs(firsts[1] - 0.5 / 0.9) < 0.03 and abs(firsts[3] - 0.1 / 0.9) < 0.02
