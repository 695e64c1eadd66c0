"""Packing a forward: what each row of a tree attends (ancestor bits) and where it sits
(positions, logical KV positions), for any tree (property tests); chunks are causal."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.model.batch import ancestor_bits, chunk_input, tree_input
from specdec.tree import DraftTree
from tests.specdec.test_tree import ancestors, trees


def _visible(row_len: int, bits: int) -> set[int]:
    """Logical KV positions a row sees: [0, row_len) and row_len + j for each bit j."""
    return set(range(row_len)) | {row_len + j for j in range(64) if (bits >> j) & 1}


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 300))
def test_each_node_sees_exactly_the_prefix_the_root_its_ancestors_and_itself(tree, L):
    item = tree_input("s", L, 7, tree.tokens, tree.parents, tree.depths)
    n = len(tree)
    assert len(item.tokens) == n + 1 and item.tokens[0] == 7
    assert _visible(item.row_len[0], item.row_bits[0]) == set(range(L + 1))  # the root: the prefix and itself
    for i in range(n):
        want = set(range(L + 1)) | {L + 1 + a for a in ancestors(tree, i) | {i}}
        assert _visible(item.row_len[i + 1], item.row_bits[i + 1]) == want, (i, tree)


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 300))
def test_positions_are_prefix_length_plus_depth_and_nodes_are_written_behind_the_root(tree, L):
    item = tree_input("s", L, 7, tree.tokens, tree.parents, tree.depths)
    assert item.positions == [L] + [L + d for d in tree.depths]
    assert item.write_at == list(range(L, L + len(tree) + 1))
    assert item.logit_rows == list(range(len(tree) + 1))


def test_a_chain_and_a_chunk_are_causal():
    chain = DraftTree.chain([5, 6, 7])
    assert ancestor_bits(chain.parents) == [0b1, 0b11, 0b111]
    item = chunk_input("s", 10, [1, 2, 3])
    assert item.positions == item.write_at == [10, 11, 12]
    assert [_visible(r, b) for r, b in zip(item.row_len, item.row_bits)] == [set(range(11)), set(range(12)),
                                                                             set(range(13))]
    assert item.logit_rows == [2]
