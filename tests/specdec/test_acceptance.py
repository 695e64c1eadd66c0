"""Acceptance rules: tree walk (sample, then match) and DSSD-split chain rejection sampling.

The statistical tests use a synthetic, context-dependent target over a small vocabulary
(no model: fast, and the exact joint distribution of the next tokens is enumerable):
the tokens emitted through verification rounds must follow the target's own sampling
distribution (chi-square, fixed seeds). Each statistic is shown to catch a deliberately
wrong acceptance rule, so a pass means something.
"""

from __future__ import annotations

import itertools
import zlib
from functools import lru_cache

import pytest
import torch

from specdec import acceptance
from specdec.acceptance import (TreeAcceptance, more_candidates, rejection_sample_chain, rejection_walk_tree,
                                sparse_rejection, walk_tree)
from specdec.proposal import Proposal, check_proposals, draw_without_replacement, make_proposal
from specdec.residual import ResidualSampler
from specdec.sampling import SamplingParams, sample_from_probs, sample_token, target_probs
from specdec.tree import DraftTree
from tests.specdec.test_sampling import chi_square_pvalue

V = 5  # vocabulary of the synthetic models
D = 3  # emitted tokens whose joint distribution is tested (V**D = 125 cells)
PROMPT = (1, 3)
TRIALS = 3000


@lru_cache(maxsize=None)
def _noise(salt: int, ctx: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr((salt, ctx)).encode()))
    return torch.randn(V, generator=g)  # [V]


def target_logits(ctx: tuple[int, ...]) -> torch.Tensor:
    return 1.3 * _noise(0, ctx)  # [V]


def draft_logits(ctx: tuple[int, ...]) -> torch.Tensor:
    """A draft that agrees with the target only partly."""
    return 0.8 * target_logits(ctx) + 0.9 * _noise(1, ctx)  # [V]


def draft_tree(ctx: tuple[int, ...]) -> DraftTree:
    """The fixed tree policy: draft top-2 at the root, top-2 / top-1 below, a chain to depth 3,
    and one arbitrary branch (possibly a duplicate sibling)."""
    a, b = torch.topk(draft_logits(ctx), 2).indices.tolist()
    a1, a2 = torch.topk(draft_logits(ctx + (a,)), 2).indices.tolist()
    b1 = int(torch.argmax(draft_logits(ctx + (b,))))
    a11 = int(torch.argmax(draft_logits(ctx + (a, a1))))
    odd = zlib.crc32(repr(ctx).encode()) % V
    return DraftTree((a, b, a1, a2, b1, a11, odd), (-1, -1, 0, 0, 1, 2, -1))


def tree_logits(tree: DraftTree, ctx: tuple[int, ...]) -> torch.Tensor:
    """[n + 1, V]: row 0 = the root's next-token logits, row i + 1 = node i's."""
    rows = [target_logits(ctx)]
    for i in range(len(tree)):
        rows.append(target_logits(ctx + tuple(tree.tokens[j] for j in tree.path_to(i))))
    return torch.stack(rows)


def exact_joint(params: SamplingParams, d: int = D) -> dict[tuple[int, ...], float]:
    """The target's own distribution of its next ``d`` sampled tokens after PROMPT."""
    out = {}
    for seq in itertools.product(range(V), repeat=d):
        p = 1.0
        for j in range(d):
            p *= float(target_probs(target_logits(PROMPT + seq[:j]), params)[seq[j]])
        out[seq] = p
    return out


# -- tree walk: the rule under test and wrong rules the statistic must catch ---------
def wrong_top2(tree, logits, params, g, **_):
    """Accept a child whenever its token is in the target's top-2 (no sampling there)."""
    accepted, pos = [], 0
    while True:
        top2 = set(torch.topk(target_probs(logits[pos], params), 2).indices.tolist())
        nxt = next((c for c in tree.children[pos] if tree.tokens[c] in top2), None)
        if nxt is None:
            return TreeAcceptance(tuple(accepted), sample_token(logits[pos], params, g))
        accepted.append(nxt)
        pos = nxt + 1


def wrong_accept_first_child(tree, logits, params, g, **_):
    """Accept the root's first draft token without sampling, then walk correctly below it."""
    first = tree.children[0][0]
    accepted, pos = [first], first + 1
    while True:
        tok = sample_token(logits[pos], params, g)
        nxt = next((c for c in tree.children[pos] if tree.tokens[c] == tok), None)
        if nxt is None:
            return TreeAcceptance(tuple(accepted), tok)
        accepted.append(nxt)
        pos = nxt + 1


def emitted_by_tree_rounds(rule, params: SamplingParams, seed: int) -> tuple[int, ...]:
    """Verification rounds from PROMPT until D tokens are emitted; returns the first D."""
    g = torch.Generator().manual_seed(seed)
    ctx, out = PROMPT, []
    while len(out) < D:
        tree = draft_tree(ctx)
        acc = rule(tree, tree_logits(tree, ctx), params, g)
        emitted = [tree.tokens[a] for a in acc.accepted] + [acc.bonus]
        out += emitted
        ctx += tuple(emitted)
    return tuple(out[:D])


def pvalue_of(samples: list[tuple[int, ...]], params: SamplingParams) -> float:
    counts: dict = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    return chi_square_pvalue(counts, exact_joint(params))


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.5, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_tree_walk_emits_the_target_distribution(params):
    samples = [emitted_by_tree_rounds(walk_tree, params, seed) for seed in range(TRIALS)]
    assert pvalue_of(samples, params) > 1e-3


@pytest.mark.parametrize("rule", [wrong_top2, wrong_accept_first_child])
def test_the_statistic_catches_a_wrong_tree_rule(rule):
    params = SamplingParams(temperature=1.0)
    samples = [emitted_by_tree_rounds(rule, params, seed) for seed in range(TRIALS)]
    assert pvalue_of(samples, params) < 1e-6


def test_trees_actually_get_accepted():
    """The statistical test exercises deep acceptance, not only bonus tokens."""
    params = SamplingParams(temperature=1.0)
    lengths = []
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        tree = draft_tree(PROMPT)
        lengths.append(len(walk_tree(tree, tree_logits(tree, PROMPT), params, g).accepted))
    assert sum(1 for n in lengths if n >= 1) > 100 and sum(1 for n in lengths if n >= 2) > 30


# -- chain mode: server rejection sampling + the edge's residual sample --------------
def draft_probs(ctx, params: SamplingParams) -> torch.Tensor:
    return target_probs(draft_logits(ctx), SamplingParams(temperature=max(params.temperature, 0.5)))  # [V]


def edge_residual(acc, q: torch.Tensor, g_edge, g_server, refill: int = 4) -> int:
    """The edge's residual sample, asking the server half for more candidates while they run out."""
    sampler = ResidualSampler(acc.rejection, q, g_edge)
    while (tok := sampler.sample()) is None:
        sampler.extend(more_candidates(acc.tail, refill, g_server))
    return tok


def emitted_by_chain_rounds(params: SamplingParams, seed: int, k: int = 2, max_entries: int = V,
                            mistake: str | None = None) -> tuple[int, ...]:
    """The test plays the edge: draft k tokens from q, send q(x); resample on rejection."""
    g_server = torch.Generator().manual_seed(seed)
    g_edge = torch.Generator().manual_seed(10**6 + seed)
    ctx, out = PROMPT, []
    while len(out) < D:
        toks, qs, q_full = [], [], []
        for _ in range(k):
            q = draft_probs(ctx + tuple(toks), params)
            x = sample_from_probs(q, g_edge)
            toks.append(x), qs.append(float(q[x])), q_full.append(q)
        logits = torch.stack([target_logits(ctx + tuple(toks[:i])) for i in range(k + 1)])  # [k + 1, V]
        if mistake == "always_accept":
            acc = rejection_sample_chain(toks, [1e-9] * k, logits, params, g_server, max_entries)
        else:
            acc = rejection_sample_chain(toks, qs, logits, params, g_server, max_entries)
        emitted = toks[: acc.num_accepted]
        if acc.bonus is not None:
            emitted.append(acc.bonus)
        else:
            q_rej = q_full[acc.num_accepted]
            if mistake == "resample_from_p":
                emitted.append(sample_from_probs(target_probs(logits[acc.num_accepted], params), g_edge))
            else:
                emitted.append(edge_residual(acc, q_rej, g_edge, g_server))
        out += emitted
        ctx += tuple(emitted)
    return tuple(out[:D])


@pytest.mark.parametrize("params, max_entries", [
    (SamplingParams(temperature=1.0), V),
    (SamplingParams(temperature=0.7, top_p=0.85), V),
    (SamplingParams(temperature=1.2, top_k=3), 3),  # the reply holds all of p (top_k <= K)
    (SamplingParams(temperature=1.5), 2),  # head + tail candidates (and refills)
    (SamplingParams(temperature=1.5), 1),
])
def test_chain_rejection_sampling_emits_the_target_distribution(params, max_entries):
    samples = [emitted_by_chain_rounds(params, seed, max_entries=max_entries) for seed in range(TRIALS)]
    assert pvalue_of(samples, params) > 1e-3


@pytest.mark.parametrize("mistake", ["always_accept", "resample_from_p"])
def test_the_statistic_catches_wrong_chain_rules(mistake):
    params = SamplingParams(temperature=1.0)
    samples = [emitted_by_chain_rounds(params, seed, mistake=mistake) for seed in range(TRIALS)]
    assert pvalue_of(samples, params) < 1e-6


# -- tree rejection sampling: siblings drawn without replacement from a sent proposal -------------
SAMPLED_SHAPE = ((4, 3), (2, 2), (5, 1), (3, 1))  # (proposal entries, children) of: root, its 1st and 2nd
# child, the 1st child's 1st child; entries < V leave some of p outside the proposal (residual only)


@lru_cache(maxsize=None)
def _proposal(ctx: tuple[int, ...], temperature: float, entries: int) -> Proposal:
    return make_proposal(draft_probs(ctx, SamplingParams(temperature=temperature)), entries)


def sampled_tree(ctx, params: SamplingParams, g, topk_children: bool = False):
    """The edge's tree for the rejection walk: children drawn without replacement from a
    sparse proposal of the draft (``topk_children``: the draft's top-k instead -- not samples)."""
    tokens, parents, props = [], [], [None]

    def grow(parent: int, path: tuple[int, ...], entries: int, m: int) -> list[int]:
        prop = _proposal(ctx + path, params.temperature, entries)
        kids = list(prop.ids[:m]) if topk_children else draw_without_replacement(prop, m, g)
        props[parent + 1] = (prop.ids, prop.weights)
        for t in kids:
            tokens.append(t), parents.append(parent), props.append(None)
        return list(range(len(tokens) - len(kids), len(tokens)))

    (e0, m0), (e1, m1), (e2, m2), (e3, m3) = SAMPLED_SHAPE
    root_kids = grow(-1, (), e0, m0)
    a_kids = grow(root_kids[0], (tokens[root_kids[0]],), e1, m1)
    if len(root_kids) > 1:
        grow(root_kids[1], (tokens[root_kids[1]],), e2, m2)
    grow(a_kids[0], (tokens[root_kids[0]], tokens[a_kids[0]]), e3, m3)
    tree = DraftTree(tuple(tokens), tuple(parents))
    return tree, check_proposals(tree, props, V)


def emitted_by_sampled_tree_rounds(params: SamplingParams, seed: int, topk_children: bool = False):
    g_server = torch.Generator().manual_seed(seed)
    g_edge = torch.Generator().manual_seed(10**6 + seed)
    ctx, out, depth = PROMPT, [], 0
    while len(out) < D:
        tree, props = sampled_tree(ctx, params, g_edge, topk_children)
        acc = rejection_walk_tree(tree, tree_logits(tree, ctx), props, params, g_server)
        emitted = [tree.tokens[a] for a in acc.accepted] + [acc.bonus]
        depth = max(depth, len(acc.accepted))
        out += emitted
        ctx += tuple(emitted)
    return tuple(out[:D])


def iid_sibling_step(p, q, children, g):
    """SpecInfer's rule for i.i.d. siblings (q never updated): wrong for siblings drawn
    without replacement."""
    r = p.clone()
    for i, c in enumerate(children):
        if torch.rand((), generator=g, dtype=torch.float64).item() * float(q[c]) < float(r[c]):
            return i, c
        r = torch.clamp(r - q, min=0.0)
        r = r / r.sum()
    return None, sample_from_probs(r, g)


def residual_is_p_step(p, q, children, g):
    """After a rejection, go on with p itself instead of norm(max(0, p - q))."""
    q = q.clone()
    for i, c in enumerate(children):
        if torch.rand((), generator=g, dtype=torch.float64).item() * float(q[c]) < float(p[c]):
            return i, c
        q[c] = 0.0
        q = q / q.sum()
    return None, sample_from_probs(p, g)


TREE_PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.3), SamplingParams(temperature=1.5),
               SamplingParams(temperature=1.5, top_k=3), SamplingParams(temperature=1.0, top_p=0.8)]


@pytest.mark.parametrize("params", TREE_PARAMS,
                         ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_tree_rejection_sampling_emits_the_target_distribution(params):
    samples = [emitted_by_sampled_tree_rounds(params, seed) for seed in range(TRIALS)]
    assert pvalue_of(samples, params) > 1e-3


@pytest.mark.parametrize("mistake", ["iid_siblings", "residual_is_p", "topk_children"])
def test_the_statistic_catches_wrong_tree_rejection_rules(mistake, monkeypatch):
    """Test of the test: the i.i.d.-sibling rule (no q update), p instead of the residual, and
    the rejection rule on deterministic top-k children (not samples of q) all fail it."""
    params = SamplingParams(temperature=1.0)
    if mistake == "iid_siblings":
        monkeypatch.setattr(acceptance, "multi_draft_step", iid_sibling_step)
    if mistake == "residual_is_p":
        monkeypatch.setattr(acceptance, "multi_draft_step", residual_is_p_step)
    samples = [emitted_by_sampled_tree_rounds(params, seed, mistake == "topk_children") for seed in range(TRIALS)]
    assert pvalue_of(samples, params) < 1e-6


def test_sampled_trees_accept_deep_and_beyond_the_first_sibling():
    """The statistic exercises later siblings and depth, not only the first child."""
    params = SamplingParams(temperature=1.0)
    later, deep = 0, 0
    for seed in range(400):
        g = torch.Generator().manual_seed(seed)
        tree, props = sampled_tree(PROMPT, params, g)
        acc = rejection_walk_tree(tree, tree_logits(tree, PROMPT), props, params, g)
        later += bool(acc.accepted) and acc.accepted[0] != tree.children[0][0]
        deep += len(acc.accepted) >= 2
    assert later > 30 and deep > 60, (later, deep)


# -- the residual alone, on a vocabulary of 512 ------------------------------------------------
VB = 512


def flat_target_and_sharp_draft(temperature: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """p: a flat-ish target over 512 tokens (most of its mass outside any small top-K); q: a
    sharper draft of it, so the residual max(0, p - q) lies mostly in p's tail."""
    logits = 1.6 * torch.randn(VB, generator=torch.Generator().manual_seed(seed))  # [VB]
    p = target_probs(logits, SamplingParams(temperature=temperature))
    q = target_probs(logits + 0.5 * torch.randn(VB, generator=torch.Generator().manual_seed(seed + 1)),
                     SamplingParams(temperature=0.6 * temperature))
    return p, q  # [VB], [VB]


def exact_residual(p: torch.Tensor, q: torch.Tensor) -> dict[int, float]:
    r = torch.clamp(p.double() - q.double(), min=0.0)
    return {i: float(v) for i, v in enumerate(r / r.sum())}


def truncated_topk_residual(p, q, k, g) -> int:
    """The old edge: the residual of the target's top-K only (mass outside it lost)."""
    vals, ids = torch.topk(p, k)
    sparse = torch.zeros(VB, dtype=torch.float64)
    sparse[ids] = vals.double()
    r = torch.clamp(sparse - q.double(), min=0.0)
    return sample_from_probs(r if r.sum() > 0 else sparse, g)


@pytest.mark.parametrize("temperature, k, old_fails", [(1.5, 4, True), (1.5, 64, True), (1.0, 4, True),
                                                      (0.3, 4, False), (0.3, 64, False)])
def test_the_residual_is_exact_when_p_does_not_fit_in_the_reply(temperature, k, old_fails):
    """Head + tail candidates (+ refills) sample norm(max(0, p - q)) exactly, also with K = 4
    on a flat 512-token target; the old top-K residual does not where p's tail carries the
    residual (at T = 0.3 it is nearly all inside the top-4, so the old error is small)."""
    p, q = flat_target_and_sharp_draft(temperature)
    assert int((p > 0).sum()) > k  # the reply cannot hold all of p
    g_server, g_edge, g_old = (torch.Generator().manual_seed(s) for s in (1, 2, 3))
    gap = 0.05  # q(x) - p(x) of some rejected token: only sizes the reply
    ours, old, refills, sent = {}, {}, 0, 0
    for _ in range(6000):
        rej, tail = sparse_rejection(p, gap, k, g_server)
        sent += len(rej.head_ids) + len(rej.tail_ids)
        sampler = ResidualSampler(rej, q, g_edge)
        while (tok := sampler.sample()) is None:
            refills += 1
            sampler.extend(more_candidates(tail, k, g_server))
        ours[tok] = ours.get(tok, 0) + 1
        t = truncated_topk_residual(p, q, k, g_old)
        old[t] = old.get(t, 0) + 1
    want = exact_residual(p, q)
    assert chi_square_pvalue(ours, want) > 1e-3
    if old_fails:
        assert chi_square_pvalue(old, want) < 1e-6
    assert sent <= 6000 * 2 * k


def test_reply_size_adapts():
    """All of p when its support fits; a small head and few candidates for a peaked p and a
    clear rejection; up to K of each for a flat p and a narrow one."""
    p, _ = flat_target_and_sharp_draft(1.0)
    g = torch.Generator().manual_seed(0)
    top = SamplingParams(temperature=1.0, top_k=10)
    pk = target_probs(torch.log(p), top)
    rej, tail = sparse_rejection(pk, 0.3, 16, g)
    assert tail is None and rej.tail_mass == 0 and len(rej.head_ids) == 10
    assert sorted(rej.head_ids) == sorted(torch.topk(p, 10).indices.tolist())
    peaked = target_probs(torch.log(p), SamplingParams(temperature=0.2))
    rej, tail = sparse_rejection(peaked, 0.4, 64, g)
    assert tail is not None and len(rej.head_ids) + len(rej.tail_ids) <= 12
    assert abs(sum(rej.head_probs) + rej.tail_mass - 1) < 1e-5
    assert all(y not in rej.head_ids and tail[y] > 0 and abs(py - float(peaked[y])) < 1e-9
               for y, py in zip(rej.tail_ids, rej.tail_probs))
    rej, _ = sparse_rejection(p, 1e-4, 64, g)
    assert len(rej.tail_ids) == 64 and len(rej.head_ids) <= 64


# -- deterministic behaviour -----------------------------------------------------------
def one_hot_rows(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    rows = torch.zeros(len(argmaxes), vocab)
    for r, a in enumerate(argmaxes):
        rows[r, a] = 5.0
    return rows  # [len, vocab]


GREEDY = SamplingParams()


def test_greedy_walk_follows_argmax_and_stops_at_the_first_miss():
    # root -> 0:4 -> 2:6 ; root -> 1:5 -> 3:7
    tree = DraftTree((4, 5, 6, 7), (-1, -1, 0, 1))
    # argmax: root 5, node0 6, node1 7, node2 -, node3 9
    logits = one_hot_rows([5, 6, 7, 0, 9])
    assert walk_tree(tree, logits, GREEDY, None) == TreeAcceptance((1, 3), 9)
    logits = one_hot_rows([8, 6, 7, 0, 9])  # root miss: bonus only
    assert walk_tree(tree, logits, GREEDY, None) == TreeAcceptance((), 8)
    assert walk_tree(DraftTree.empty(), one_hot_rows([3]), GREEDY, None) == TreeAcceptance((), 3)


def test_duplicate_siblings_take_the_first_match():
    tree = DraftTree((4, 4, 6), (-1, -1, 1))
    assert walk_tree(tree, one_hot_rows([4, 1, 6, 2]), GREEDY, None) == TreeAcceptance((0,), 1)


def test_stop_token_and_max_emit_end_the_walk():
    tree = DraftTree.chain([4, 5, 6])
    logits = one_hot_rows([4, 5, 6, 7])
    assert walk_tree(tree, logits, GREEDY, None) == TreeAcceptance((0, 1, 2), 7)
    assert walk_tree(tree, logits, GREEDY, None, stop_ids=frozenset({5})) == TreeAcceptance((0,), 5)
    for cap in (1, 2, 3):
        acc = walk_tree(tree, logits, GREEDY, None, max_emit=cap)
        assert len(acc.accepted) + 1 == cap and acc.bonus == [4, 5, 6][cap - 1]


def test_seeded_walk_reproduces_sequential_sampling_with_one_uniform_per_token():
    """Same seed: the walk emits exactly what sampling token by token would, drawing once per token."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    for seed in range(30):
        g_ref = torch.Generator().manual_seed(seed)
        seq = []
        for _ in range(6):
            seq.append(sample_token(target_logits(PROMPT + tuple(seq)), params, g_ref))
        # a tree with a decoy branch first, then the true path to depth 4
        tree = DraftTree(((seq[0] + 1) % V, *seq[:4]), (-1, -1, 1, 2, 3))
        g = torch.Generator().manual_seed(seed)
        acc = walk_tree(tree, tree_logits(tree, PROMPT), params, g)
        assert [tree.tokens[a] for a in acc.accepted] + [acc.bonus] == seq[:5]
        g_twin = torch.Generator().manual_seed(seed)
        torch.rand(5, generator=g_twin, dtype=torch.float64)
        assert g.get_state().equal(g_twin.get_state())


def test_greedy_chain_accepts_matching_argmaxes():
    logits = one_hot_rows([4, 5, 6, 7])
    acc = rejection_sample_chain([4, 5, 6], [0.5] * 3, logits, GREEDY, None)
    assert (acc.num_accepted, acc.bonus) == (3, 7)
    acc = rejection_sample_chain([4, 9, 6], [0.5] * 3, logits, GREEDY, None)
    assert (acc.num_accepted, acc.bonus) == (1, 5)  # the correction is the argmax


def test_rejection_returns_the_sparse_target_distribution():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(logits[0], 0)
    g = torch.Generator().manual_seed(0)
    # q(x) = 1 for a token of target probability ~0.03: rejected with probability ~0.97
    for params, head in [(SamplingParams(temperature=1.0, top_k=2), [1, 3]), (SamplingParams(temperature=1.0), None)]:
        acc = next(a for a in (rejection_sample_chain([0], [1.0], logits, params, g, max_entries=2)
                               for _ in range(20)) if a.bonus is None)
        assert acc.num_accepted == 0
        if head is not None:  # top_k = 2 <= K: all of p, nothing kept
            assert list(acc.rejection.head_ids) == head and acc.rejection.tail_mass == 0 and acc.tail is None
            assert torch.allclose(torch.tensor(acc.rejection.head_probs), p[head] / p[head].sum())
        else:  # the head and i.i.d. candidates from the rest; the tail is kept for refills
            rej = acc.rejection
            assert list(rej.head_ids) == [1, 3][: len(rej.head_ids)]
            assert abs(rej.tail_mass + sum(rej.head_probs) - 1) < 1e-6 and rej.tail_ids
            assert all(y not in rej.head_ids for y in rej.tail_ids)
            assert torch.allclose(torch.tensor(rej.tail_probs), p[list(rej.tail_ids)])
            assert acc.tail is not None and float(acc.tail[list(rej.head_ids)].sum()) == 0
