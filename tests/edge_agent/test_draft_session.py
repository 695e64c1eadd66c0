"""Drafters with tree KV, proactive drafting, alignment detection and reuse (SpecEdge §4.2)."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.model.loading import tiny_random_model
from edge_agent.draft_backends import ModelDrafter, NgramDrafter
from edge_agent.draft_session import DraftSession
from edge_agent.tree_builder import ROOT, TreeConfig
from tests.edge_agent.helpers import hf_topk, noisy_copy

PREFIX = [1, 5, 17, 33, 99, 4, 250]


@pytest.fixture(scope="module")
def draft_model():
    return noisy_copy(tiny_random_model(seed=0), 0.005)


def check_candidates(model, session: DraftSession, k: int):
    """Every fed node's candidates equal a plain HF forward on prefix + its path."""
    b = session.builder
    checked = 0
    for nid in [ROOT, *b.nodes]:
        n = b.node(nid)
        if n.cands is None:
            continue
        toks, lps = hf_topk(model, session.prefix + b.path_tokens(nid), k)
        assert n.cands[0] == toks
        assert max(abs(x - y) for x, y in zip(n.cands[1], lps)) < 1e-4
        checked += 1
    return checked


def test_tree_kv_gives_the_same_candidates_as_a_fresh_forward(draft_model):
    s = DraftSession(ModelDrafter(draft_model), TreeConfig(budget=16, topk=3, max_expand=4))
    s.start(PREFIX)
    assert s.draft(4) == 4
    tree, order = s.freeze()
    assert len(tree) == 16 and tree.depth <= 4
    assert check_candidates(draft_model, s, 3) >= 5


def aligned_reply(s: DraftSession):
    """The server reply under which the proactive chain aligns: path to the leaf + P1."""
    tree, order = s.sent
    path = s.builder.path(s.leaf)
    accepted = [order.index(n) for n in path]
    bonus = s.chain[0].token
    return accepted, bonus, [s.builder.node(n).token for n in path] + [bonus]


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_alignment_reuses_exactly_what_a_fresh_draft_would_produce(draft_model, steps):
    d = ModelDrafter(draft_model)
    s = DraftSession(d, TreeConfig(budget=12, topk=3, max_expand=3))
    s.start(PREFIX)
    s.draft(3)
    s.freeze(max_chain=steps)
    while s.proactive_step():
        pass
    assert len(s.chain) == steps
    chain = [p.token for p in s.chain]
    accepted, bonus, emitted = aligned_reply(s)
    al = s.on_reply(accepted, bonus, emitted)
    assert al.attempted and al.aligned and al.reused == steps - 1
    new_prefix = PREFIX + emitted
    assert s.prefix == new_prefix
    # a fresh greedy chain from the new prefix, by plain HF forwards
    ctx, fresh = list(new_prefix), []
    for _ in range(steps - 1):
        t = hf_topk(draft_model, ctx, 1)[0][0]
        fresh.append(t)
        ctx.append(t)
    reused, n = [], s.builder.root  # follow the draft's top-1 child from the new root
    while n.cands is not None and n.cands[0]:
        nxt = [c for c in n.children if s.builder.nodes[c].token == n.cands[0][0]]
        if not nxt:
            break
        n = s.builder.nodes[nxt[0]]
        reused.append(n.token)
    reused = reused[: steps - 1] if steps > 1 else []
    assert chain[1:] == fresh
    assert reused == fresh  # the seeded tree starts with the proactive chain
    # and the kept draft KV is right: growing the seeded tree matches fresh forwards
    s.draft(2)
    assert check_candidates(draft_model, s, 3) >= steps
    # the draft KV holds exactly the new prefix + the fed tree nodes
    assert d.cached == new_prefix[: len(d.cached)] and len(d.cached) >= len(new_prefix) - 1


def test_misaligned_replies_discard_the_proactive_chain(draft_model):
    d = ModelDrafter(draft_model)
    s = DraftSession(d, TreeConfig(budget=12, topk=3, max_expand=3))
    s.start(PREFIX)
    s.draft(3)
    s.freeze(max_chain=3)
    while s.proactive_step():
        pass
    accepted, bonus, emitted = aligned_reply(s)
    # the path reaches the leaf but the bonus differs from P1
    wrong = (bonus + 1) % 512
    al = s.on_reply(accepted, wrong, emitted[:-1] + [wrong])
    assert al.attempted and not al.aligned and al.reused == 0
    assert len(s.builder) == 0 and not s.builder.root.expanded
    s.draft(2)
    assert check_candidates(draft_model, s, 3) >= 2

    # the path stops before the leaf (only the root's first child accepted)
    s2 = DraftSession(ModelDrafter(draft_model), TreeConfig(budget=12, topk=3, max_expand=3))
    s2.start(PREFIX)
    s2.draft(3)
    s2.freeze(max_chain=3)
    s2.proactive_step()
    path = s2.builder.path(s2.leaf)
    assert len(path) >= 2
    tree, order = s2.sent
    first = s2.builder.node(path[0])
    al = s2.on_reply([order.index(path[0])], s2.chain[0].token, [first.token, s2.chain[0].token])
    assert al.attempted and not al.aligned
    s2.draft(1)
    assert check_candidates(draft_model, s2, 3) >= 1

    # no proactive token in hand: not an attempt
    s3 = DraftSession(ModelDrafter(draft_model), TreeConfig(budget=4, topk=2, max_expand=2))
    s3.start(PREFIX)
    s3.draft(2)
    s3.freeze(max_chain=0)
    assert not s3.proactive_step()
    al = s3.on_reply([], 7, [7])
    assert not al.attempted and not al.aligned


def test_empty_tree_and_proactive_from_the_root(draft_model):
    s = DraftSession(ModelDrafter(draft_model), TreeConfig(budget=8, topk=2, max_expand=2))
    s.start(PREFIX)
    tree, _ = s.freeze(max_chain=2)
    assert len(tree) == 0
    assert s.proactive_step() and s.proactive_step()
    p1 = s.chain[0].token
    assert p1 == hf_topk(draft_model, PREFIX, 1)[0][0]
    al = s.on_reply([], p1, [p1])
    assert al.aligned and al.reused == 1


def test_deep_drafting_stops_at_the_drafters_tree_positions(draft_model):
    """A round that feeds 8 nodes per forward for many levels (deep server hints on easy text)
    runs out of the draft KV's 64 tree positions: drafting and the proactive chain stop there
    (they raised ValueError before), and the tree stays within its budget."""
    from specdec.model.batch import MAX_TREE_BITS

    d = ModelDrafter(draft_model)
    s = DraftSession(d, TreeConfig(budget=64, topk=4, max_expand=8, max_depth=32))
    s.start(PREFIX)
    assert s.draft(30) < 30
    assert 0 <= d.room() < 8
    tree, _ = s.freeze(max_chain=8)
    assert len(tree) == 64
    while s.proactive_step():
        pass
    assert d.room() == 0 and len(d.slots) == MAX_TREE_BITS
    assert check_candidates(draft_model, s, 4) >= 8


def test_ngram_drafter_proposes_what_followed():
    ng = NgramDrafter(max_n=3)
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3]
    ng._index(ctx)
    toks, lps = ng.lookup(ctx, 4)
    # "2 3" was followed by 4 and by 5 (once each); the most recent first on ties
    assert toks == [5, 4]
    assert all(math.isclose(lp, math.log(0.5)) for lp in lps)
    # a longer match wins over a shorter one: "1 2 3" was only followed by 4
    ctx2 = [7, 1, 2, 3, 4, 0, 2, 3, 5, 0, 2, 3, 5, 1, 2, 3]
    ng2 = NgramDrafter(max_n=3)
    ng2._index(ctx2)
    assert ng2.lookup(ctx2, 4)[0] == [4]
    assert NgramDrafter(max_n=2).expand(ctx2, [__import__("edge_agent.draft_backends").draft_backends.ExpandRequest(ROOT, 3, 0)],
                                        4)[0][0] == [5, 4]
    assert ng.lookup([999], 4) == ([], [])
    # drafting a tree with the same interface
    s = DraftSession(ng, TreeConfig(budget=8, topk=2, max_expand=2))
    s.start([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    s.draft(4)
    tree, _ = s.freeze()
    assert tree.tokens[:1] == (3,) and tree.depth >= 3  # follows "... 1 2" -> 3 4 1 ...


def test_uncommitted_tree_entries_are_seen_only_by_rows_that_name_them():
    """What the drafter relies on: entries written past the committed prefix (held) are
    invisible to rows whose bits do not name them; compaction turns a path into prefix."""
    from specdec.model.batch import SeqInput, chunk_input
    from specdec.model.runner import ModelRunner

    m = tiny_random_model(seed=0)
    r = ModelRunner(m)
    ids = [3, 9, 27, 81, 243]
    ref = r.forward(0, [chunk_input("s", 0, ids)])[0].float()
    r.abort(0)
    r.forward(1, [chunk_input("s", 0, ids[:3])])
    r.commit(1, {"s": (3, [])})
    # two junk tree nodes at positions 3, 4, held; then ids[3:] at positions 5, 6 that skip them
    r.forward(2, [SeqInput("s", [400, 401], [3, 3], [3, 4], [3, 3], [0b01, 0b10], [0])])
    r.hold(2)
    out = r.forward(3, [SeqInput("s", ids[3:], [3, 4], [5, 6], [3, 3], [0b0100, 0b1100], [1])])[0].float()
    r.hold(3)
    assert torch.allclose(out, ref, atol=1e-5)
    r.pool.compact("s", 3, [5, 6], 5)  # the path ids[3:] becomes prefix; the junk is gone
    assert r.kv_length("s") == 5
    out = r.forward(4, [chunk_input("s", 4, ids[4:])])[0].float()
    assert torch.allclose(out, ref, atol=1e-5)


def test_a_prefill_forward_is_not_timed_as_a_draft_level(draft_model):
    """The forward that feeds the prompt (or a re-open's history) is no level's cost: timing it would make the
    FlexSpec depth rule draft one level a round until the estimate decays (edge_agent.draft_session.record_forward)."""
    s = DraftSession(ModelDrafter(draft_model), TreeConfig(budget=8, topk=2, max_expand=2))
    s.start(list(range(1, 41)))  # 40 prompt tokens: the first forward prefills them
    s.draft(3)
    assert s.forwards == 3 and len(s.forward_times) == 2  # the two levels below the root
    tree, order = s.freeze()
    s.on_reply([0], 7, [tree.tokens[0], 7])  # two new tokens: the next forward is a level again
    s.draft(1)
    assert len(s.forward_times) == 3
