"""The edge's own guesses in the pre-draft cache (edge_agent/predraft.py, no early results).

At the start of a round the cache feeds the estimated-verified nodes the tree left unfed, then
keeps the likeliest outcomes (accepted path ending at a verified node ``v``, bonus ``t`` one of
``v``'s draft candidates that is not a verified child) as entries; a reply that matches one
installs its tree, which is exactly what a fresh draft from the new prefix would build.
"""

from __future__ import annotations

import math

import pytest

from specdec.model.loading import tiny_random_model
from edge_agent.draft_backends import ModelDrafter
from edge_agent.draft_session import DraftSession
from edge_agent.predraft import PreDraftCache
from edge_agent.tree_builder import ROOT, TreeConfig
from tests.edge_agent.helpers import noisy_copy
from tests.edge_agent.test_draft_session import check_candidates

PREFIX = [1, 5, 17, 33, 99, 4, 250]
CFG = TreeConfig(budget=6, topk=3, max_expand=3)


@pytest.fixture(scope="module")
def draft_model():
    return noisy_copy(tiny_random_model(seed=0), 0.005)


def sent_round(draft_model, k: int, max_entries: int = 32) -> tuple[DraftSession, PreDraftCache]:
    ds = DraftSession(ModelDrafter(draft_model), CFG)
    ds.start(PREFIX)
    ds.draft(2)
    ds.freeze()
    pc = PreDraftCache(ds, max_entries=max_entries)
    pc.begin_round(len(PREFIX), ds.forwards, guess_nodes=k)
    assert pc.pending()
    assert pc.step()  # the guesses (and the forward feeding the leaves they need)
    return ds, pc


def all_outcomes(ds: DraftSession, k: int) -> list[tuple[float, tuple[int, ...], int]]:
    """Every outcome the draft can estimate, by an independent walk over the verified prefix."""
    b, (_, order) = ds.builder, ds.sent
    verified = order[:k]
    out = []
    for v in [ROOT] + verified:
        n = b.node(v)
        kids = [b.node(c).token for c in n.children if c in verified]
        acc = tuple(order.index(x) for x in b.path(v))
        out += [(math.exp(n.logp + lp), acc, t) for t, lp in zip(*n.cands) if t not in kids]
    return sorted(out, key=lambda o: -o[0])


@pytest.mark.parametrize("k", [0, 2, 6])
def test_guesses_are_the_likeliest_outcomes_of_the_verified_prefix(draft_model, k):
    ds, pc = sent_round(draft_model, k)
    _, order = ds.sent
    assert all(ds.builder.node(n).expanded for n in order[:k])  # the leaves a guess needs were fed
    want = all_outcomes(ds, k)
    got = sorted(pc.entries.values(), key=lambda e: -e.confidence)
    assert [(e.key[0], e.key[1]) for e in got] == [(a, t) for _, a, t in want]
    assert [e.confidence for e in got] == pytest.approx([p for p, _, _ in want])
    if k == 0:  # nothing verified: every candidate at the root is a bonus, tree children included
        assert {e.key for e in got} == {((), t) for t in ds.builder.root.cands[0]}
    assert pc.stats.guessed == len(got)


def test_at_most_max_entries_most_probable_first(draft_model):
    ds, pc = sent_round(draft_model, 6, max_entries=3)
    want = all_outcomes(ds, 6)[:3]
    assert sorted(e.key for e in pc.entries.values()) == sorted((a, t) for _, a, t in want)


def test_a_matching_reply_installs_the_tree_a_fresh_draft_would_build(draft_model):
    ds, pc = sent_round(draft_model, 6, max_entries=4)
    while pc.pending():
        pc.step()
    best = max(pc.entries.values(), key=lambda e: e.confidence)
    (accepted, bonus), prefix = best.key, ds.prefix
    hit = pc.take(list(accepted), bonus)
    assert hit is best and pc.stats.hits == 1 and pc.stats.early_hits == 0
    pc.install(hit)
    assert ds.prefix == prefix + hit.emitted
    assert ds.builder.forwards == ds.forwards > 0 and len(ds.builder) > 0
    assert check_candidates(draft_model, ds, CFG.topk) > 1  # the KV kept under the new prefix is exact


def test_a_reply_no_guess_matches_is_a_miss(draft_model):
    ds, pc = sent_round(draft_model, 6)
    guessed = {e.key[1] for e in pc.entries.values()}
    other = next(t for t in range(3, 1000) if t not in guessed)
    assert pc.take([], other) is None and pc.stats.misses == 1 and not pc.entries
    assert not pc.pending()
