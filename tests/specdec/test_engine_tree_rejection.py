"""Tree rejection sampling through the engine (issue 17, item 3) on tiny random Llamas (fp32).

A 512-token vocabulary with flat rows: the edge's proposals (16 entries) leave much of p
outside them, so emitted tokens often come from the residual the *server* samples; the draft
(:func:`draft_rows`) is shaped so that later siblings win in every case. The first two emitted
tokens of thousands of seeded sessions must follow the target's marginals (chi-square); a wrong
residual, and the i.i.d.-sibling rule, fail the statistic at T = 0.3 and 1.0. Greedy through the same path equals
target-only decoding token for token.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import InvalidRequest
from specdec import acceptance
from specdec.proposal import Proposal, draw_without_replacement, make_proposal
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest, VerifyResult
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from tests.specdec.test_acceptance import iid_sibling_step, residual_is_p_step
from tests.specdec.test_chain_verify import V_BIG, big_rows, case_id
from tests.specdec.test_engine import EOS, STAT_PROMPT, STAT_ROOT, counts_of, generated, random_prompt
from tests.specdec.test_sampling import chi_square_pvalue

SESSIONS = 2500
ENTRIES = 16  # proposal entries: at T >= 1 most of p lies outside them
CONFIDENT = 0.8  # the draft's mass on the target's argmax (draft_rows)


@pytest.fixture(scope="module")
def model_512():
    from specdec.model.loading import tiny_random_model

    return tiny_random_model(seed=1)


def sampled_tree(q_root: torch.Tensor, q_next, g: torch.Generator):
    """Root: 3 children drawn without replacement from a 16-entry proposal of ``q_root``; the
    first has 2 children drawn from ``q_next(token)``'s. Returns the tree and its wire proposals."""
    prop = make_proposal(q_root, ENTRIES)
    kids = draw_without_replacement(prop, 3, g)
    tokens, parents, props = list(kids), [-1] * len(kids), [(prop.ids, prop.weights)] + [None] * len(kids)
    sub = make_proposal(q_next(kids[0]), ENTRIES)
    grand = draw_without_replacement(sub, 2, g)
    props[1] = (sub.ids, sub.weights)
    tokens += grand
    parents += [0] * len(grand)
    props += [None] * len(grand)
    return DraftTree(tuple(tokens), tuple(parents)), tuple(props), set(prop.ids)


def draft_rows(model, params: SamplingParams):
    """p1 [V], p2 [V, V] as :func:`big_rows`, and a *confident* draft: CONFIDENT on the target's
    argmax, the rest the target at 0.6 x T (same top-k/top-p). A sharp draft alone never lets a
    later sibling win at T >= 1 on flat rows: its 16-entry proposal, renormalised, lies above p
    everywhere, so the residual max(0, p - q) has no mass on any sibling. With the peak, the
    first child is mostly the argmax and is rejected (q >> p there), and the later siblings come
    from a proposal tail lying under p, where the residual does have mass: the rule's q update
    (without replacement) is exercised at every temperature."""
    p1, p2, s1, s2 = big_rows(model, params)

    def peaked(p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        top = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).to(p.dtype)
        return CONFIDENT * top + (1.0 - CONFIDENT) * s

    return p1, p2, peaked(p1, s1), peaked(p2, s2)


def two_tokens(model, params: SamplingParams):
    """SESSIONS seeded sessions after STAT_PROMPT + [STAT_ROOT]; the test plays the edge
    (the draft of :func:`draft_rows`); rounds until two tokens exist."""
    p1, p2, q1, q2 = draft_rows(model, params)
    eng = VerifierEngine(model, eos_token_ids=())
    sids = [f"t{i}" for i in range(SESSIONS)]
    eng.open([OpenRequest(sid, STAT_PROMPT, SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=i, max_tokens=8),
        generated=(STAT_ROOT,)) for i, sid in enumerate(sids)])
    g = torch.Generator().manual_seed(123)
    stats = dict(outside=0, later_sibling=0, deep=0)
    reqs = []
    for sid in sids:
        tree, props, support = sampled_tree(q1, lambda a: q2[a], g)
        reqs.append((VerifyRequest(sid, tree, len(STAT_PROMPT) + 1, proposals=props), support))
    for (req, support), res in zip(reqs, eng.verify([r for r, _ in reqs])):
        assert isinstance(res, VerifyResult), res
        stats["outside"] += res.tokens[0] not in support
        stats["later_sibling"] += bool(res.accepted) and res.accepted[0] != 0
        stats["deep"] += len(res.accepted) >= 2
    short = [sid for sid in sids if eng.sessions[sid].num_generated < 3]
    reqs = []
    for sid in short:
        a = generated(eng, sid)[1]
        prop = make_proposal(q2[a], ENTRIES)
        kids = draw_without_replacement(prop, 3, g)
        reqs.append(VerifyRequest(sid, DraftTree(tuple(kids), (-1,) * len(kids)), len(eng.sessions[sid].prefix),
                                  proposals=((prop.ids, prop.weights),) + (None,) * len(kids)))
    assert all(isinstance(r, VerifyResult) for r in eng.verify(reqs))
    samples = [tuple(generated(eng, sid)[1:3]) for sid in sids]
    marg1 = {a: float(p1[a]) for a in range(V_BIG)}
    p2m = (p1.double()[:, None] * p2.double()).sum(0)  # [V] the second token's marginal
    marg2 = {b: float(p2m[b]) for b in range(V_BIG)}
    return (chi_square_pvalue(counts_of(s[0] for s in samples), marg1),
            chi_square_pvalue(counts_of(s[1] for s in samples), marg2), stats)


CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.3), SamplingParams(temperature=1.5),
         SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.5, top_p=0.9)]


@pytest.mark.parametrize("params", CASES, ids=case_id)
def test_tree_rejection_through_the_engine_follows_the_target(model_512, params):
    pv1, pv2, st = two_tokens(model_512, params)
    assert pv1 > 1e-3 and pv2 > 1e-3, (pv1, pv2, st)
    assert st["deep"] > 50, st  # depth is exercised
    assert st["later_sibling"] > 100, st  # so are later siblings (the q update without replacement)
    if params.temperature >= 1.0 and params.top_k == 0:
        assert st["outside"] > 200, st  # the server's residual reaches p's mass outside the proposal


@pytest.mark.parametrize("temperature", [0.3, 1.0])
@pytest.mark.parametrize("step", [residual_is_p_step, iid_sibling_step], ids=["residual_is_p", "iid_siblings"])
def test_the_engine_statistic_catches_a_wrong_residual(model_512, monkeypatch, step, temperature):
    """Test of the test, at a peaked and a flat target: the i.i.d.-sibling rule (q keeps the
    rejected children) and p in place of the residual both fail it."""
    monkeypatch.setattr(acceptance, "multi_draft_step", step)
    pv1, pv2, st = two_tokens(model_512, SamplingParams(temperature=temperature))
    assert st["later_sibling"] > 100, st
    assert min(pv1, pv2) < 1e-6, (pv1, pv2, st)


def test_greedy_tree_rejection_equals_reference(tiny_model):
    """Greedy sessions through the proposal path: token for token target-only decoding."""
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    prompt = random_prompt(rng, 512)
    params = SamplingParams(max_tokens=30)
    want = reference_decode(tiny_model, prompt, params, (EOS,))
    eng.open([OpenRequest("g", prompt, params)])
    s = eng.sessions["g"]
    q = torch.softmax(torch.randn(512, generator=g), 0)
    while not s.finished:
        prop = make_proposal(q, 8)
        truth = want[s.num_generated]
        ids, weights = (prop.ids + (truth,), prop.weights + (1,)) if truth not in prop.ids else (prop.ids, prop.weights)
        kids = draw_without_replacement(Proposal(ids, weights), 3, g)
        if rng.random() < 0.6 and truth not in kids:
            kids[-1] = truth
        tree = DraftTree(tuple(kids), (-1,) * len(kids))
        res = eng.verify([VerifyRequest("g", tree, len(s.prefix), proposals=((ids, weights),) + (None,) * len(kids))])
        assert isinstance(res[0], VerifyResult), res
    assert generated(eng, "g") == want


def test_bad_proposals_are_a_clear_400_and_leave_the_session_intact(tiny_model):
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    eng.open([OpenRequest("b", [5, 6, 7], SamplingParams(temperature=1.0, seed=1, max_tokens=10))])
    n = len(eng.sessions["b"].prefix)
    tree = DraftTree((10, 11), (-1, -1))
    for props in (((10,), (5,)), None, None), (((10, 11), (5, 0)), None, None), (((10, 11), (5, 5)),):
        (res,) = eng.verify([VerifyRequest("b", tree, n, proposals=props)])
        assert isinstance(res, InvalidRequest) and res.status == 400, res
    assert len(eng.sessions["b"].prefix) == n
    (res,) = eng.verify([VerifyRequest("b", tree, n, proposals=(((10, 11, 12), (5, 5, 1)), None, None), limit=0)])
    assert isinstance(res, VerifyResult) and res.verified == 2  # never truncated by the limit
