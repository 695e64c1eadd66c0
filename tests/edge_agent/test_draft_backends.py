"""ModelDrafter's packed weights (edge_agent/draft_backends.py): one copy per draft model in a process,
shared by its drafters, each with its own KV; their proposals are those of a drafter alone."""

from __future__ import annotations

from edge_agent.draft_backends import ExpandRequest, ModelDrafter, packed_model
from edge_agent.tree_builder import ROOT

PREFIX_A = [1, 5, 9, 33, 7, 100]
PREFIX_B = [4, 8, 15, 16, 23, 42, 99, 3]


def root(prefix):
    return [ExpandRequest(ROOT, prefix[-1], 0)]


def test_drafters_of_one_model_share_its_packed_weights_and_keep_their_own_kv(draft):
    alone = ModelDrafter(draft).expand(PREFIX_A, root(PREFIX_A), 8)
    a, b = ModelDrafter(draft), ModelDrafter(draft)
    assert a.runner.model is b.runner.model is packed_model(draft)  # packed once
    assert a.runner.pool is not b.runner.pool
    b.expand(PREFIX_B, root(PREFIX_B), 8)  # the other session's KV: in its own pool
    assert a.expand(PREFIX_A, root(PREFIX_A), 8) == alone
    assert packed_model(a.runner.model) is a.runner.model
