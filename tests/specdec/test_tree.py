"""Draft tree structure: validation errors, depths, paths, children (property tests)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.errors import InvalidRequest, InvalidTree
from specdec.tree import DraftTree, TreeLimits

VOCAB = 100


@st.composite
def trees(draw, max_nodes: int = 64) -> DraftTree:
    """Any valid tree: parents listed first, parents[i] in [-1, i)."""
    n = draw(st.integers(0, max_nodes))
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    tokens = tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)))
    return DraftTree(tokens, parents)


def ancestors(tree: DraftTree, i: int) -> set[int]:
    out = set()
    p = tree.parents[i]
    while p >= 0:
        out.add(p)
        p = tree.parents[p]
    return out


@settings(max_examples=200, deadline=None)
@given(trees())
def test_depths_and_paths_are_consistent(tree):
    for i in range(len(tree)):
        path = tree.path_to(i)
        assert path[-1] == i and path[0] >= 0 and tree.parents[path[0]] == -1
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:]))
        assert tree.depths[i] == len(path) == len(ancestors(tree, i)) + 1
    assert tree.depth == max(tree.depths, default=0)
    # children is the inverse of parents, each node listed exactly once
    listed = sorted(c for ch in tree.children for c in ch)
    assert listed == list(range(len(tree)))
    for p_plus_1, ch in enumerate(tree.children):
        assert all(tree.parents[c] == p_plus_1 - 1 for c in ch)


@settings(max_examples=200, deadline=None)
@given(trees())
def test_valid_trees_validate(tree):
    assert tree.validate(VOCAB, TreeLimits(max_nodes=64, max_depth=64)) is tree


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-3, 70), max_size=40))
def test_arbitrary_parent_arrays_are_accepted_iff_they_form_a_tree(parents):
    tree = DraftTree(tuple([1] * len(parents)), tuple(parents))
    ok = all(-1 <= p < i for i, p in enumerate(parents))
    if ok:
        tree.validate(VOCAB, TreeLimits(64, 64))
    else:
        with pytest.raises(InvalidTree):
            tree.validate(VOCAB, TreeLimits(64, 64))


def test_chain_is_a_path():
    t = DraftTree.chain([5, 6, 7])
    assert t.parents == (-1, 0, 1) and t.depths == (1, 2, 3)
    assert DraftTree.chain([]) == DraftTree.empty()


@pytest.mark.parametrize(
    "tree, limits, allow_empty, fragment",
    [
        (DraftTree((1, 2), (-1, 1)), TreeLimits(), True, "parent 1"),  # a node its own parent
        (DraftTree((1, 2), (-1, 5)), TreeLimits(), True, "parent 5"),  # parent after the child
        (DraftTree((1, 2), (-1, -2)), TreeLimits(), True, "parent -2"),
        (DraftTree((1, VOCAB), (-1, 0)), TreeLimits(), True, "outside the vocabulary"),
        (DraftTree((-1,), (-1,)), TreeLimits(), True, "outside the vocabulary"),
        (DraftTree((1, 2), (-1,)), TreeLimits(), True, "parent indices"),  # lengths differ
        (DraftTree.empty(), TreeLimits(), False, "empty"),
        (DraftTree((1,) * 5, (-1,) * 5), TreeLimits(max_nodes=4), True, "limit is 4"),
        (DraftTree.chain([1] * 4), TreeLimits(max_depth=3), True, "depth 4 exceeds"),
    ],
)
def test_invalid_trees_raise_typed_errors(tree, limits, allow_empty, fragment):
    with pytest.raises(InvalidTree) as e:
        tree.validate(VOCAB, limits, allow_empty=allow_empty)
    assert fragment in str(e.value)
    assert isinstance(e.value, InvalidRequest)
    assert e.value.status == 400 and e.value.code == "invalid_tree"
    assert e.value.to_dict()["error"]["code"] == "invalid_tree"


def test_limits_are_inclusive():
    DraftTree((1,) * 4, (-1,) * 4).validate(VOCAB, TreeLimits(max_nodes=4))
    DraftTree.chain([1] * 3).validate(VOCAB, TreeLimits(max_depth=3))
    DraftTree.empty().validate(VOCAB, TreeLimits(), allow_empty=True)
