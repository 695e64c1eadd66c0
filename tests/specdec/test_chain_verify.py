"""Chain verification (DSSD split rejection sampling) through the engine on tiny random Llamas:
the emitted tokens follow the target's distribution for any reply size, greedy chains equal
target-only decoding, invalid requests leave the session intact, ``more`` refills."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specdec.engine import ChainVerifyRequest, ChainVerifyResult, OpenRequest, VerifierEngine, VerifyRequest
from specdec.errors import InvalidRequest, PrefixMismatch, SpecError
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.residual import Rejection, ResidualSampler
from specdec.sampling import SamplingParams, sample_from_probs, target_probs
from specdec.tree import DraftTree
from tests.specdec.test_engine import (EOS, STAT_PROMPT, STAT_ROOT, STAT_SESSIONS, V_STAT, assert_intact,  # noqa: F401
                                       counts_of, exact_two_token_joint, generated, model_small, random_prompt,
                                       snapshot)
from tests.specdec.test_sampling import chi_square_pvalue


def rejection_of(res: ChainVerifyResult) -> Rejection:
    return Rejection(res.reject_top_ids, res.reject_top_probs, res.tail_mass, res.tail_ids, res.tail_probs)


def edge_resample(eng: VerifierEngine, sid: str, res: ChainVerifyResult, q: torch.Tensor, g: torch.Generator,
                  wrong: str | None = None, p: torch.Tensor | None = None) -> tuple[int, int]:
    """The edge's residual sample after a rejection: with the reply and its own q, asking the
    engine for more candidates while they run out; returns (token, refills). ``wrong``:
    'from_p' samples p itself, 'topk' the old rule (the residual of the reply's top-K of p
    only: ``p`` is the exact target distribution there, the test's knowledge)."""
    if wrong == "from_p":
        return sample_from_probs(p, g), 0
    if wrong == "topk":
        k = len(res.reject_top_ids) or 1
        vals, ids = torch.topk(p, k)
        sparse = torch.zeros_like(p, dtype=torch.float64)
        sparse[ids] = vals.double()
        r = torch.clamp(sparse - q.double(), min=0.0)
        return sample_from_probs(r if r.sum() > 0 else sparse, g), 0
    sampler, refills = ResidualSampler(rejection_of(res), q, g), 0
    while (tok := sampler.sample()) is None:
        refills += 1
        (more,) = eng.verify_chain([ChainVerifyRequest(sid, (), (), res.prefix_len, more=True)])
        assert isinstance(more, ChainVerifyResult) and more.bonus is None and not more.reject_top_ids, more
        sampler.extend(rejection_of(more))
    return tok, refills


def sample_two_tokens_via_chain(model, params: SamplingParams, k: int = 3,
                                resample_from_p: bool = False) -> list[tuple[int, int]]:
    """Chain mode; the test plays the edge: drafts from a fixed q, sends q(x), resamples on rejection."""
    eng = VerifierEngine(model, eos_token_ids=(), chain_top_k=V_STAT)
    sids = [f"c{i}" for i in range(STAT_SESSIONS)]
    eng.open([OpenRequest(sid, STAT_PROMPT, replace(params, seed=i, max_tokens=8), generated=(STAT_ROOT,))
              for i, sid in enumerate(sids)])
    q = torch.softmax(torch.linspace(2.0, -2.0, V_STAT), 0)  # [V] context-free draft distribution
    edge_g = {sid: torch.Generator().manual_seed(50_000 + i) for i, sid in enumerate(sids)}
    emitted = {sid: [] for sid in sids}
    owed: dict[str, int] = {}
    while True:
        reqs = []
        for sid in sids:
            if len(emitted[sid]) >= 2:
                continue
            toks = [sample_from_probs(q, edge_g[sid]) for _ in range(k)]
            r = owed.pop(sid, None)
            prefix_len = len(STAT_PROMPT) + 1 + len(emitted[sid])
            reqs.append(ChainVerifyRequest(sid, tuple(toks), tuple(float(q[t]) for t in toks), prefix_len,
                                           resampled=r))
        if not reqs:
            break
        for req, res in zip(reqs, eng.verify_chain(reqs)):
            assert isinstance(res, ChainVerifyResult), res
            emitted[req.sid] += list(req.tokens[: res.num_accepted])
            if res.bonus is not None:
                emitted[req.sid].append(res.bonus)
            else:  # rejected: the edge samples the replacement from the residual
                assert res.tail_mass == 0  # K = V: the reply holds all of p
                p = torch.zeros(V_STAT)
                p[list(res.reject_top_ids)] = torch.tensor(res.reject_top_probs)
                tok, _ = edge_resample(eng, req.sid, res, q, edge_g[req.sid],
                                       "from_p" if resample_from_p else None, p)
                emitted[req.sid].append(tok)
                owed[req.sid] = tok
    for sid in sids:  # the server's session agrees with what the edge saw
        s = eng.sessions[sid]
        assert s.prefix[s.prompt_len + 1:] == emitted[sid][: len(s.prefix) - s.prompt_len - 1]
    return [tuple(emitted[sid][:2]) for sid in sids]


def test_chain_rejection_sampling_samples_the_target_distribution(model_small):
    params = SamplingParams(temperature=1.0)
    joint = exact_two_token_joint(model_small, params)
    assert chi_square_pvalue(counts_of(sample_two_tokens_via_chain(model_small, params)), joint) > 1e-3


def test_chain_statistic_catches_resampling_from_p(model_small):
    params = SamplingParams(temperature=1.0)
    joint = exact_two_token_joint(model_small, params)
    samples = sample_two_tokens_via_chain(model_small, params, resample_from_p=True)
    assert chi_square_pvalue(counts_of(samples), joint) < 1e-6


# -- chain rejection sampling on a 512-token vocabulary: exact whatever K -------------------------
V_BIG = 512
BIG_SESSIONS = 2500


@pytest.fixture(scope="module")
def model_512():
    return tiny_random_model(seed=1)  # vocab 512: its rows are flat (at T = 1.5 the top-4 hold ~6%)


def big_rows(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """p and the edge's q at the first two positions after STAT_PROMPT + [STAT_ROOT]: p1 [V],
    p2 [V, V] (row a: after token a), q1, q2 likewise. The draft is the target at 0.6 x the
    temperature with the same top-k/top-p: sharper than p, so the residual max(0, p - q)
    lies mostly in p's tail, outside any small top-K."""
    ctx = STAT_PROMPT + [STAT_ROOT]
    qp = SamplingParams(temperature=0.6 * params.temperature, top_k=params.top_k, top_p=params.top_p)
    with torch.inference_mode():
        l1 = model(torch.tensor([ctx])).logits[0, -1]  # [V]
        l2 = model(torch.tensor([ctx + [a] for a in range(V_BIG)])).logits[:, -1]  # [V, V]
    return target_probs(l1, params), target_probs(l2, params), target_probs(l1, qp), target_probs(l2, qp)


def chain_two_tokens_512(model, params: SamplingParams, chain_top_k: int, wrong: str | None = None):
    """BIG_SESSIONS seeded sessions; the test plays the edge (chains of 2 drawn from q, its
    residual sample on a rejection with refills); returns the first two emitted tokens of
    each session and counters (rejections, refills, tail replies, entries sent)."""
    p1, p2, q1, q2 = big_rows(model, params)
    eng = VerifierEngine(model, eos_token_ids=(), chain_top_k=chain_top_k)
    sids = [f"b{i}" for i in range(BIG_SESSIONS)]
    eng.open([OpenRequest(sid, STAT_PROMPT, SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=i, max_tokens=8),
        generated=(STAT_ROOT,)) for i, sid in enumerate(sids)])
    edge_g = {sid: torch.Generator().manual_seed(1000 + i) for i, sid in enumerate(sids)}
    emitted: dict[str, list[int]] = {sid: [] for sid in sids}
    owed: dict[str, int] = {}
    stats = dict(rejections=0, refills=0, tail=0, entries=0, accepted=0)

    def q_at(sid: str, toks: list[int]) -> torch.Tensor:
        seq = emitted[sid] + toks
        return q1 if not seq else q2[seq[0]]

    def p_at(sid: str, toks: list[int]) -> torch.Tensor:
        seq = emitted[sid] + toks
        return p1 if not seq else p2[seq[0]]

    while True:
        reqs = []
        for sid in sids:
            if len(emitted[sid]) >= 2:
                continue
            toks: list[int] = []
            for _ in range(2 - len(emitted[sid])):
                toks.append(sample_from_probs(q_at(sid, toks), edge_g[sid]))
            qs = tuple(float(q_at(sid, toks[:i])[t]) for i, t in enumerate(toks))
            reqs.append(ChainVerifyRequest(sid, tuple(toks), qs, len(STAT_PROMPT) + 1 + len(emitted[sid]),
                                           resampled=owed.pop(sid, None)))
        if not reqs:
            break
        for req, res in zip(reqs, eng.verify_chain(reqs)):
            assert isinstance(res, ChainVerifyResult), res
            n = res.num_accepted
            stats["accepted"] += n
            toks = list(req.tokens[:n])
            if res.bonus is not None:
                emitted[req.sid] += toks + [res.bonus]
                continue
            stats["rejections"] += 1
            stats["tail"] += res.tail_mass > 0
            stats["entries"] += len(res.reject_top_ids) + len(res.tail_ids)
            assert len(res.reject_top_ids) <= chain_top_k and len(res.tail_ids) <= chain_top_k
            tok, refills = edge_resample(eng, req.sid, res, q_at(req.sid, toks), edge_g[req.sid], wrong,
                                         p_at(req.sid, toks))
            stats["refills"] += refills
            emitted[req.sid] += toks + [tok]
            owed[req.sid] = tok
    samples = [tuple(emitted[sid][:2]) for sid in sids]
    marg1 = {a: float(p1[a]) for a in range(V_BIG)}
    p2m = (p1.double()[:, None] * p2.double()).sum(0)  # [V] marginal of the second token
    marg2 = {b: float(p2m[b]) for b in range(V_BIG)}
    pv1 = chi_square_pvalue(counts_of(s[0] for s in samples), marg1)
    pv2 = chi_square_pvalue(counts_of(s[1] for s in samples), marg2)
    return pv1, pv2, stats


BIG_CASES = [  # (params, chain_top_k, p fits in the reply)
    (SamplingParams(temperature=1.0), 64, False),  # full vocabulary: the top-64 hold ~60%
    (SamplingParams(temperature=0.3), 64, False),
    (SamplingParams(temperature=1.5), 4, False),  # flat: ~94% of p outside the top-4
    (SamplingParams(temperature=1.0, top_k=50), 64, True),  # all of p in the reply
    (SamplingParams(temperature=1.0, top_k=50), 4, False),
    (SamplingParams(temperature=1.5, top_p=0.9), 16, False),
    (SamplingParams(temperature=0.3, top_p=0.9), 64, True),
]


def case_id(v) -> str:
    return f"T{v.temperature}-k{v.top_k}-p{v.top_p}" if isinstance(v, SamplingParams) else str(v)


@pytest.mark.parametrize("params, chain_top_k, fits", BIG_CASES, ids=case_id)
def test_chain_rejection_through_the_engine_is_exact_for_any_k(model_512, params, chain_top_k, fits):
    """Issue 17: exact whether or not p's support fits in the reply (head + tail candidates +
    refills otherwise): the first two emitted tokens follow the target's marginals."""
    pv1, pv2, st = chain_two_tokens_512(model_512, params, chain_top_k)
    assert pv1 > 1e-3 and pv2 > 1e-3, (pv1, pv2, st)
    assert st["rejections"] > 300 and st["accepted"] > 100, st  # both paths are exercised
    assert (st["tail"] == 0) == fits, st
    if chain_top_k == 4 and not fits:
        assert st["refills"] > 0, st  # candidates ran out and the edge asked for more


@pytest.mark.parametrize("wrong", ["from_p", "topk"])
def test_the_512_statistic_catches_a_wrong_residual(model_512, wrong):
    """Test of the test: resampling from p, or the old residual of p's top-K only, fails it."""
    pv1, pv2, _ = chain_two_tokens_512(model_512, SamplingParams(temperature=1.5), 4, wrong=wrong)
    assert min(pv1, pv2) < 1e-6


def test_greedy_chain_mode_equals_reference(tiny_model):
    rng = random.Random(5)
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    prompt = random_prompt(rng, 512)
    params = SamplingParams(max_tokens=30)
    want = reference_decode(tiny_model, prompt, params, (EOS,))
    eng.open([OpenRequest("c", prompt, params)])
    s = eng.sessions["c"]
    while not s.finished:
        rem = want[s.num_generated:]
        k = rng.randint(0, 6)
        toks = [t if rng.random() < 0.7 else rng.randrange(512) for t in rem[:k]]
        toks += [rng.randrange(512) for _ in range(k - len(toks))]
        res = eng.verify_chain([ChainVerifyRequest("c", tuple(toks), (0.5,) * len(toks), len(s.prefix))])[0]
        assert isinstance(res, ChainVerifyResult) and res.bonus is not None  # greedy never asks to resample
    assert generated(eng, "c") == want


def test_invalid_chain_requests_leave_the_session_intact(tiny_model):
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=60)
    eng.open([OpenRequest("c", [5, 6, 7], params)])
    s = eng.sessions["c"]
    q_bad = [
        ChainVerifyRequest("c", (1, 2), (0.5,), len(s.prefix)),  # one q per token
        ChainVerifyRequest("c", (1,), (0.0,), len(s.prefix)),
        ChainVerifyRequest("c", (1,), (1.5,), len(s.prefix)),
        ChainVerifyRequest("c", (1, 512), (0.5, 0.5), len(s.prefix)),
        ChainVerifyRequest("c", (1,), (0.5,), len(s.prefix) + 1),
        ChainVerifyRequest("c", (1,), (0.5,), len(s.prefix), resampled=3),  # nothing owed
    ]
    for req in q_bad:
        snap = snapshot(eng, "c")
        res = eng.verify_chain([req])[0]
        assert isinstance(res, (InvalidRequest, PrefixMismatch)), (req, res)
        assert_intact(eng, "c", snap)
    # get a rejection (an unlikely token with q = 1 is rejected with high probability)
    for _ in range(20):
        res = eng.verify_chain([ChainVerifyRequest("c", (1, 1), (1.0, 1.0), len(s.prefix))])[0]
        if res.bonus is None and not res.finished:
            break
    assert res.bonus is None and res.prefix_len == len(s.prefix) + 1 and s.awaiting_resample
    for req in [ChainVerifyRequest("c", (1,), (0.5,), res.prefix_len),  # resampled missing
                ChainVerifyRequest("c", (1, 512), (0.5, 0.5), res.prefix_len, resampled=4),  # bad tree
                ChainVerifyRequest("c", (1,), (0.5,), res.prefix_len, resampled=512),
                ChainVerifyRequest("c", (1,), (0.5,), res.prefix_len - 1, resampled=4)]:
        snap = snapshot(eng, "c")
        out = eng.verify_chain([req])[0]
        assert isinstance(out, SpecError), (req, out)
        assert_intact(eng, "c", snap) and s.awaiting_resample
    assert isinstance(eng.verify([VerifyRequest("c", DraftTree.empty(), res.prefix_len)])[0], SpecError)
    out = eng.verify_chain([ChainVerifyRequest("c", (1,), (0.5,), res.prefix_len, resampled=4)])[0]
    assert isinstance(out, ChainVerifyResult) and s.prefix[res.prefix_len - 1] == 4
    # KV holds the prefix minus its root; after a rejection the owed resampled token is the root
    assert s.finished or eng.runner.kv_length("c") == len(s.prefix) - (0 if s.awaiting_resample else 1)


def test_requests_for_more_residual_candidates(tiny_model):
    """``more``: fresh tail candidates of the pending rejection without a forward; invalid ones
    leave the session intact; a session that owes nothing (re-opened) gets a whole rejection."""
    forwards = []
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,), chain_top_k=4, on_forward=forwards.append)
    params = SamplingParams(temperature=1.5, seed=1, max_tokens=60, ignore_eos=True)
    eng.open([OpenRequest("c", [5, 6, 7], params), OpenRequest("g", [5, 6, 7], SamplingParams(max_tokens=9))])
    s = eng.sessions["c"]
    more = lambda n: ChainVerifyRequest("c", (), (), n, more=True)  # noqa: E731
    # nothing owed: the next position's p as a rejection (one forward of the root; the head is full)
    n_fwd = len(forwards)
    res = eng.verify_chain([more(len(s.prefix) + 1)])[0]
    assert isinstance(res, ChainVerifyResult) and res.bonus is None and res.num_accepted == 0
    assert len(res.reject_top_ids) == 4 and len(res.tail_ids) == 4 and res.tail_mass > 0.5
    assert len(forwards) == n_fwd + 1 and s.awaiting_resample and res.prefix_len == len(s.prefix) + 1
    for bad, err in [(ChainVerifyRequest("c", (1,), (0.5,), res.prefix_len, more=True), InvalidRequest),
                     (ChainVerifyRequest("c", (), (), res.prefix_len, resampled=3, more=True), InvalidRequest),
                     (more(res.prefix_len - 1), PrefixMismatch), (more(res.prefix_len + 1), PrefixMismatch),
                     (ChainVerifyRequest("g", (), (), len(eng.sessions["g"].prefix) + 1, more=True), InvalidRequest)]:
        snap = snapshot(eng, "c")
        assert isinstance(eng.verify_chain([bad])[0], err), bad
        assert_intact(eng, "c", snap) and s.awaiting_resample
    # refills: fresh i.i.d. candidates from p's tail, no head, no forward
    n_fwd = len(forwards)
    seen = set()
    for _ in range(5):
        r = eng.verify_chain([more(res.prefix_len)])[0]
        assert r.bonus is None and not r.reject_top_ids and len(r.tail_ids) == 4
        assert abs(r.tail_mass - res.tail_mass) < 1e-6 and not set(r.tail_ids) & set(res.reject_top_ids)
        seen |= set(r.tail_ids)
    assert len(forwards) == n_fwd and len(seen) > 4
    # the owed token goes on as usual and ends the pending rejection
    owed = seen.pop()
    out = eng.verify_chain([ChainVerifyRequest("c", (9,), (0.5,), res.prefix_len, resampled=owed)])[0]
    assert isinstance(out, ChainVerifyResult) and s.prefix[res.prefix_len - 1] == owed
    assert s.awaiting_resample == out.rejected and (s.residual_tail is not None) == (out.rejected and out.tail_mass > 0)
    # a rejection that carried all of p has nothing more to send
    eng.open([OpenRequest("k", [5, 6, 7], SamplingParams(temperature=1.0, top_k=3, seed=2, max_tokens=60))])
    sk = eng.sessions["k"]
    for _ in range(50):  # token 1 with q = 1 is rejected almost surely
        r = eng.verify_chain([ChainVerifyRequest("k", (1,), (1.0,), len(sk.prefix))])[0]
        if r.rejected:
            break
    assert r.rejected and r.tail_mass == 0 and len(r.reject_top_ids) == 3 and sk.residual_tail is None
    assert isinstance(eng.verify_chain([ChainVerifyRequest("k", (), (), r.prefix_len, more=True)])[0],
                      InvalidRequest)
