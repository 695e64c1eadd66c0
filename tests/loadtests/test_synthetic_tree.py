"""Synthetic trees: valid trees, acceptance that follows the model, verified by the real engine."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.acceptance import walk_tree
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeLimits
from loadtests.synthetic_tree import AcceptanceModel, expected_accepted, synthetic_tree

VOCAB = 512


def greedy_accepted(tree: DraftTree, truth: list[int]) -> int:
    """Accepted nodes of a greedy target whose continuation is ``truth`` (logits = one-hot of truth)."""
    logits = torch.full((len(tree) + 1, VOCAB), -10.0)  # [n + 1, V]: row 0 = root, row i + 1 = node i
    logits[0, truth[0]] = 10.0
    for i, d in enumerate(tree.depths):
        path = tree.path_to(i)
        on_path = len(path) <= len(truth) and all(tree.tokens[j] == truth[k] for k, j in enumerate(path))
        nxt = truth[d] if on_path and d < len(truth) else 2  # off the target's path: anything but its tokens
        logits[i + 1, nxt] = 10.0
    acc = walk_tree(tree, logits, SamplingParams(max_tokens=1 << 20), None)
    return len(acc.accepted)


@pytest.mark.parametrize("alpha,sibling", [(0.0, 0.0), (0.5, 0.0), (0.7, 0.3), (1.0, 0.0), (0.2, 0.9)])
@pytest.mark.parametrize("depth,budget", [(1, 1), (4, 16), (8, 8), (6, 64)])
def test_trees_are_valid_and_hits_are_what_the_target_accepts(alpha, sibling, depth, budget):
    rng = random.Random(7)
    model = AcceptanceModel(alpha, sibling)
    for _ in range(30):
        truth = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
        tokens, parents, hits = synthetic_tree(truth, model, depth, budget, VOCAB, rng)
        tree = DraftTree(tuple(tokens), tuple(parents)).validate(VOCAB, TreeLimits(budget, depth))
        assert len(tree) == budget  # the whole node budget is used
        assert tree.depth <= depth
        assert all(t >= 3 for t in tokens)  # never a special token (EOS would end the session)
        assert hits == greedy_accepted(tree, truth)


def test_acceptance_follows_the_model_on_average():
    rng = random.Random(0)
    truth = list(range(10, 60))
    for alpha, sibling, depth in [(0.7, 0.3, 4), (0.5, 0.0, 6), (0.9, 0.5, 8)]:
        model = AcceptanceModel(alpha, sibling)
        n = 4000
        mean = sum(synthetic_tree(truth, model, depth, 32, VOCAB, rng)[2] for _ in range(n)) / n
        want = expected_accepted(model, depth)
        # sd of the accepted length < depth; 4 sigma of the mean of n rounds
        assert abs(mean - want) < 4 * depth / n ** 0.5, (alpha, sibling, depth, mean, want)


def test_expected_accepted_closed_forms():
    assert expected_accepted(AcceptanceModel(1.0, 0.0), 5) == 5
    assert expected_accepted(AcceptanceModel(0.0, 0.0), 5) == 0
    assert expected_accepted(AcceptanceModel(0.5, 0.0), 2) == pytest.approx(0.75)
    assert expected_accepted(AcceptanceModel(0.5, 0.5), 1) == pytest.approx(0.75)
    assert expected_accepted(AcceptanceModel(1.0, 0.0), 5, truth_left=2) == 2


def test_no_budget_for_siblings_means_a_chain():
    rng = random.Random(1)
    tokens, parents, _ = synthetic_tree(list(range(10, 20)), AcceptanceModel(0.5, 1.0), 5, 5, VOCAB, rng)
    assert parents == [-1, 0, 1, 2, 3]


def test_bad_probabilities_are_rejected():
    with pytest.raises(ValueError):
        AcceptanceModel(1.5, 0.0)
    with pytest.raises(ValueError):
        AcceptanceModel(0.5, -0.1)


@pytest.mark.parametrize("alpha,sibling,depth,budget", [(0.7, 0.3, 8, 8), (0.7, 0.3, 6, 8), (0.5, 0.8, 5, 7),
                                                        (0.9, 0.5, 4, 64)])
def test_expected_accepted_with_a_node_budget_matches_simulation(alpha, sibling, depth, budget):
    rng = random.Random(3)
    model = AcceptanceModel(alpha, sibling)
    truth = list(range(10, 60))
    n = 4000
    mean = sum(synthetic_tree(truth, model, depth, budget, VOCAB, rng)[2] for _ in range(n)) / n
    want = expected_accepted(model, depth, budget=budget)
    assert abs(mean - want) < 4 * depth / n ** 0.5, (mean, want)
    if budget == depth:  # no spare node for a second guess
        assert want == pytest.approx(expected_accepted(AcceptanceModel(alpha, 0.0), depth))
