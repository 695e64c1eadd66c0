"""Tree building by cumulative log-prob: budget, pruning order, valid parents, chains."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.tree import TreeLimits
from edge_agent.tree_builder import ROOT, TreeBuilder, TreeConfig


def grow(cfg: TreeConfig, seed: int, forwards: int, vocab: int = 50):
    """Grow a tree with random draft distributions.

    Returns the builder and, per draft forward, (universe {id: logp} of all nodes that
    competed, ids kept afterwards) to check the pruning rule against.
    """
    rng = random.Random(seed)
    b = TreeBuilder(cfg)
    records = []
    next_id = 0
    for _ in range(forwards):
        front = b.frontier()
        if not front:
            break
        universe = {n: b.nodes[n].logp for n in b.nodes}
        results = []
        for nid in front:
            k = rng.randint(1, cfg.topk + 1)
            toks = rng.sample(range(vocab), k)
            w = [rng.random() ** 3 + 1e-9 for _ in range(vocab)]
            z = sum(w)
            lps = sorted((math.log(w[t] / z) for t in toks), reverse=True)
            ids = list(range(next_id, next_id + k))
            next_id += k
            base = b.node(nid).logp
            if b.node(nid).depth < cfg.max_depth:
                universe.update({i: base + lp for i, lp in zip(ids[: cfg.topk], lps[: cfg.topk])})
            results.append((nid, toks, lps, ids))
        b.expand_all(results)
        records.append((universe, set(b.nodes)))
        b.forwards += 1
    return b, records


configs = st.builds(TreeConfig, budget=st.integers(1, 40), topk=st.integers(1, 6),
                    max_expand=st.integers(1, 8), max_depth=st.integers(1, 10))


@settings(max_examples=150, deadline=None)
@given(cfg=configs, seed=st.integers(0, 10_000), forwards=st.integers(0, 12))
def test_tree_is_valid_within_budget_and_depth(cfg, seed, forwards):
    b, _ = grow(cfg, seed, forwards)
    tree, order = b.to_tree()
    assert len(tree) <= cfg.budget
    tree.validate(vocab_size=50, limits=TreeLimits(max_nodes=cfg.budget, max_depth=cfg.max_depth))
    assert tree.depth <= min(b.forwards, cfg.max_depth)
    for i, nid in enumerate(order):  # wire indices map back to the same nodes
        n = b.nodes[nid]
        assert tree.tokens[i] == n.token
        assert tree.depths[i] == n.depth
        assert (tree.parents[i] == -1) == (n.parent == ROOT)
        if n.parent != ROOT:
            assert order[tree.parents[i]] == n.parent
            assert n.logp <= b.nodes[n.parent].logp
    for n in [b.root, *b.nodes.values()]:  # siblings carry distinct tokens
        toks = [b.nodes[c].token for c in n.children]
        assert len(toks) == len(set(toks))


@settings(max_examples=100, deadline=None)
@given(cfg=configs, seed=st.integers(0, 10_000), forwards=st.integers(1, 10))
def test_pruning_keeps_the_best_by_cumulative_logprob(cfg, seed, forwards):
    _, records = grow(cfg, seed, forwards)
    assert records
    for universe, kept in records:
        ranked = sorted(universe, key=lambda n: (-universe[n], n))
        assert kept == set(ranked[: cfg.budget])


def test_pruning_drops_the_lowest_and_ties_go_to_older_nodes():
    b = TreeBuilder(TreeConfig(budget=3, topk=4, max_expand=4, max_depth=8))
    kept = b.expand(ROOT, [10, 11, 12, 13], [-0.1, -1.0, -2.0, -3.0])
    assert [b.nodes[n].token for n in kept] == [10, 11, 12]
    first = kept[0]
    # children of the best node: -0.1 + -0.5 = -0.6 beats -2.0 (token 12), -0.1 - 5 does not
    kept2 = b.expand(first, [20, 21], [-0.5, -5.0])
    assert sorted(b.nodes[n].token for n in b.nodes) == [10, 11, 20]
    assert [b.nodes[n].token for n in kept2] == [20]
    # a tie with an existing node: the older node stays
    b2 = TreeBuilder(TreeConfig(budget=1, topk=2, max_expand=1))
    b2.expand(ROOT, [5, 6], [-1.0, -1.0])
    assert [n.token for n in b2.nodes.values()] == [5]


def test_frontier_is_best_first_and_respects_depth_and_full_budget():
    b = TreeBuilder(TreeConfig(budget=4, topk=2, max_expand=2, max_depth=2))
    assert b.frontier() == [ROOT]
    a, c = b.expand(ROOT, [1, 2], [-0.2, -0.9])
    assert b.frontier() == [a, c]
    kids = b.expand(a, [3, 4], [-0.1, -3.0])
    # depth-2 nodes cannot be expanded (max_depth 2)
    assert set(b.frontier()) == {c}
    assert all(b.nodes[k].depth == 2 for k in kids)
    # full tree: a frontier node ranked below the worst kept node cannot add anything
    b3 = TreeBuilder(TreeConfig(budget=2, topk=2, max_expand=4))
    x, y = b3.expand(ROOT, [1, 2], [-0.1, -0.2])
    (z,) = b3.expand(x, [3], [-0.01])  # kept: x (-0.1), its child z (-0.11); y pruned
    assert y not in b3.nodes
    assert b3.frontier() == []  # z is the worst kept node: its children would rank below it
    b3.config = TreeConfig(budget=3, topk=2, max_expand=4)
    assert b3.frontier() == [z]  # with room in the budget it can grow again


@pytest.mark.parametrize("depth", [1, 3, 7])
def test_chain_is_the_special_case(depth):
    b = TreeBuilder(TreeConfig.chain(budget=32))
    rng = random.Random(depth)
    for _ in range(depth):
        (nid,) = b.frontier()
        b.expand(nid, [rng.randrange(100), rng.randrange(100)], [-0.5, -1.0])
    tree, _ = b.to_tree()
    assert tree.parents == tuple(range(-1, depth - 1))
    assert tree.depth == depth


def test_best_leaf_and_paths():
    b = TreeBuilder(TreeConfig(budget=8, topk=2, max_expand=2))
    assert b.best_leaf() == ROOT
    a, c = b.expand(ROOT, [1, 2], [-0.3, -0.4])
    (d,) = b.expand(c, [7], [-0.01])
    # leaves: a (-0.3) and d (-0.41): the best is a
    assert b.best_leaf() == a
    assert b.path(d) == [c, d] and b.path_tokens(d) == [2, 7] and b.ancestors(d) == [c]
