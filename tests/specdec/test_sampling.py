"""The seeded sampler: processed target distribution, one uniform per token, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specdec.errors import InvalidRequest, InvalidSamplingParams
from specdec.sampling import (SamplingParams, make_generator, sample_from_probs, sample_token,
                                      target_probs)


def chi_square_pvalue(counts: dict, probs: dict, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of ``counts`` (cell -> n) to ``probs`` (cell -> p).

    Cells with expected count below ``min_expected`` are pooled into one; an observation in
    a cell of probability 0 gives p = 0. Survival function of chi2(df) = Q(df / 2, x / 2).
    """
    n = sum(counts.values())
    if any(c > 0 and probs.get(k, 0.0) <= 0.0 for k, c in counts.items()):
        return 0.0
    cells, pooled_p, pooled_c = [], 0.0, 0
    for k, p in probs.items():
        if p * n >= min_expected:
            cells.append((counts.get(k, 0), p * n))
        else:
            pooled_p, pooled_c = pooled_p + p, pooled_c + counts.get(k, 0)
    if pooled_p * n > 0:
        cells.append((pooled_c, pooled_p * n))
    df = len(cells) - 1
    if df < 1:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_chi_square_helper_accepts_a_fair_die_and_rejects_a_loaded_one():
    g = torch.Generator().manual_seed(0)
    fair = torch.randint(0, 6, (6000,), generator=g).tolist()
    probs = {k: 1 / 6 for k in range(6)}
    assert chi_square_pvalue({k: fair.count(k) for k in range(6)}, probs) > 1e-3
    loaded = torch.multinomial(torch.tensor([0.25, 0.15, 0.15, 0.15, 0.15, 0.15]), 6000, True, generator=g).tolist()
    assert chi_square_pvalue({k: loaded.count(k) for k in range(6)}, probs) < 1e-6
    assert chi_square_pvalue({0: 1}, {0: 0.0, 1: 1.0}) == 0.0
    # known quantile: chi2(5) has P(X > 11.0705) = 0.05; 6 cells of 100 expected each
    obs = {0: 100 + 23.5271, 1: 100 - 23.5271, 2: 100, 3: 100, 4: 100, 5: 100}  # stat = 2 * 23.5271^2 / 100 = 11.0705
    assert abs(chi_square_pvalue(obs, {k: 1 / 6 for k in range(6)}) - 0.05) < 1e-3


logit_vectors = st.lists(st.floats(-8, 8, allow_nan=False, allow_subnormal=False, width=32), min_size=2, max_size=40)


@settings(max_examples=150, deadline=None)
@given(logit_vectors, st.floats(0.05, 3.0), st.integers(0, 45), st.floats(0.01, 1.0))
@example([0.0, 1.0, 1e-9], 1.0, 0, 0.75)  # a float32 tie at the nucleus boundary (found by hypothesis)
def test_target_probs_is_temperature_then_top_k_then_top_p(logits, temperature, top_k, top_p):
    x = torch.tensor(logits)
    V = x.shape[0]
    params = SamplingParams(temperature=temperature, top_k=min(top_k, V), top_p=top_p)
    p = target_probs(x, params)  # [V]
    assert p.dtype == torch.float32 and p.shape == (V,)
    assert torch.all(p >= 0) and abs(float(p.sum()) - 1) < 1e-5
    base = torch.softmax(x.double() / temperature, dim=0)  # before any filter
    kept = p > 0
    if 0 < params.top_k < V:
        scaled = x / temperature  # float32, as the sampler computes it (ties stay ties)
        kth = torch.topk(scaled, params.top_k).values[-1]
        assert not torch.any(kept & (scaled < kth))  # nothing outside the top-k (ties at the k-th stay)
    # within the kept set, probabilities are proportional to the unfiltered softmax
    # (float32 keeps no relative precision below ~1e-30, so compare the normal range only)
    normal = kept & (base > 1e-30)
    ratio = p.double()[normal] / base[normal]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-3)
    # a kept token is never less likely than a dropped one (filters keep a top set), up to the
    # sampler's float32: logits 0 and 1e-9 are one value once shifted by a max of 1
    if (~kept).any():
        assert base[kept].min() >= base[~kept].max() * (1 - 1e-6) - 1e-12
    if top_p < 1.0:
        topk_p = target_probs(x, SamplingParams(temperature=temperature, top_k=params.top_k))
        mass = float(topk_p[kept].sum())
        assert mass >= top_p - 1e-5  # reaches top_p ...
        assert mass - float(topk_p[kept].min()) < top_p + 1e-5  # ... and is the smallest such set


def test_target_probs_simple_cases():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert torch.allclose(target_probs(x, SamplingParams(temperature=1.0)), torch.softmax(x, 0))
    assert torch.allclose(target_probs(x, SamplingParams(temperature=0.5)), torch.softmax(2 * x, 0))
    p = target_probs(x, SamplingParams(temperature=1.0, top_k=2))
    assert p[:2].sum() == 0 and torch.allclose(p[2:], torch.softmax(x[2:], 0))
    p = target_probs(x, SamplingParams(temperature=1.0, top_p=0.5))  # top token alone has 0.64
    assert p.tolist() == [0.0, 0.0, 0.0, 1.0]


def test_one_uniform_per_sampled_token():
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)), 0)
    g, twin = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(20):
        u = float(torch.rand((), generator=twin, dtype=torch.float64))  # the draw the sampler must use
        tok = sample_from_probs(probs, g)
        cdf = torch.cumsum(probs.double(), 0)
        assert tok == int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                                             right=True))
    assert g.get_state().equal(twin.get_state())  # exactly one draw each, nothing else


def test_greedy_is_argmax_and_draws_nothing():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample_token(logits, SamplingParams(), None) == 1
    assert make_generator(SamplingParams()) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.0, 1e-7, 0.3, 1.0, 5.0]), min_size=1, max_size=12).filter(lambda v: sum(v) > 0),
       st.integers(0, 2**32))
def test_never_samples_a_zero_probability_token(weights, seed):
    probs = torch.tensor(weights, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    for _ in range(5):
        assert probs[sample_from_probs(probs, g)] > 0


def test_sampled_frequencies_match_the_target_distribution():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(3)) * 1.5
    for params in (SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_k=5, seed=2),
                   SamplingParams(temperature=1.3, top_p=0.8, seed=3)):
        p = target_probs(logits, params)
        g = make_generator(params)
        draws = [sample_token(logits, params, g) for _ in range(6000)]
        counts = {k: draws.count(k) for k in range(12)}
        assert chi_square_pvalue(counts, dict(enumerate(p.tolist()))) > 1e-3, params
        # the same statistic catches the unfiltered distribution when a filter is active
        if params.top_k or params.top_p < 1:
            raw = torch.softmax(logits / params.temperature, 0)
            assert chi_square_pvalue(counts, dict(enumerate(raw.tolist()))) < 1e-6


def test_generator_seed_and_fast_forward():
    params = SamplingParams(temperature=1.0, seed=1234)
    a, b = make_generator(params), make_generator(params)
    assert torch.rand(5, generator=a, dtype=torch.float64).equal(torch.rand(5, generator=b, dtype=torch.float64))
    full = make_generator(params)
    skipped = make_generator(params, skip=3)
    torch.rand(3, generator=full, dtype=torch.float64)
    assert full.get_state().equal(skipped.get_state())
    other = make_generator(SamplingParams(temperature=1.0, seed=1235))
    assert not torch.rand(4, generator=other).equal(torch.rand(4, generator=make_generator(params)))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=101.0), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=101), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(stop_token_ids=(100,)), "stop token"),
    (dict(stop_token_ids=tuple(range(65))), "stop_token_ids"),
])
def test_bad_sampling_params_are_rejected(kwargs, fragment):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs).validate(vocab_size=100)
    assert fragment in str(e.value) and isinstance(e.value, InvalidRequest) and e.value.status == 400


def test_from_dict_round_trip_and_rejections():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=5, max_tokens=64, stop_token_ids=(3, 4),
                       ignore_eos=True)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict({"temperature": 0.5, "max_tokens": 7.0}) == SamplingParams(0.5, max_tokens=7)
    with pytest.raises(InvalidSamplingParams, match="unknown"):
        SamplingParams.from_dict({"temprature": 1.0})
    with pytest.raises(InvalidSamplingParams, match="integer"):
        SamplingParams.from_dict({"top_k": "many"})
    with pytest.raises(InvalidSamplingParams, match="integer"):
        SamplingParams.from_dict({"stop_token_ids": [1, None]})


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("field,value", [
    ("top_k", INF), ("max_tokens", INF), ("seed", INF), ("seed", -INF), ("max_tokens", NAN), ("top_k", 2.5),
    ("stop_token_ids", [INF]), ("stop_token_ids", 7), ("temperature", INF), ("temperature", NAN),
    ("top_p", NAN), ("temperature", "0.5"), ("max_tokens", True), ("ignore_eos", "yes"),
])
def test_non_finite_or_mistyped_numbers_are_a_clean_400(field, value):
    """Issue 14 #5: json.loads turns `Infinity` into a float; int(inf) raised OverflowError (a 500)."""
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams.from_dict({field: value}).validate(vocab_size=100)
    assert e.value.status == 400


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_tiny_temperatures_decode_greedily(temperature):
    """Issue 14 #6: logits / 1e-300 overflowed to inf and NaN probabilities emitted the last
    token id at every step; a temperature under GREEDY_BELOW is greedy."""
    p = SamplingParams(temperature=temperature, seed=1).validate(vocab_size=100)
    assert p.greedy and make_generator(p) is None
    logits = torch.randn(100)
    assert sample_token(logits, p, None) == int(logits.argmax())


def test_greedy_token_is_torch_argmax():
    """The native bf16 argmax: the first largest, ties, -0/+0, +-inf and NaN (the first NaN) as torch."""
    from specdec.sampling import greedy_token

    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        n = int(torch.randint(1, 50_000, (1,), generator=g))
        x = (torch.randn(n, generator=g) * 3).to(torch.bfloat16)
        if trial % 3 == 0:
            x[torch.randint(0, n, (3,), generator=g)] = x.max()  # ties: the first wins
        if trial % 10 == 1:
            x[torch.randint(0, n, (2,), generator=g)] = float("nan")
        if trial % 10 == 2:
            x[:] = -float("inf")
        if trial % 10 == 3:
            x[:] = 0.0
            x[torch.randint(0, n, (2,), generator=g)] = -0.0
        if trial % 10 == 4:
            x[int(torch.randint(0, n, (1,), generator=g))] = float("inf")
        assert greedy_token(x) == int(torch.argmax(x)), trial
    rows = torch.randn(4, 300).to(torch.bfloat16)
    assert greedy_token(rows[2]) == int(torch.argmax(rows[2]))  # a view into a batch
    assert greedy_token(rows[:, 7]) == int(torch.argmax(rows[:, 7]))  # strided
    assert greedy_token(rows[1].float()) == int(torch.argmax(rows[1].float()))  # float32: torch's


def test_greedy_rows_of_a_split_forward_equal_each_rows_greedy_token():
    from specdec.sampling import greedy_rows, greedy_token

    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 5, (23, 40), generator=g).to(torch.bfloat16)  # many ties: the first max wins
    parts = list(torch.split(logits, [1, 9, 0, 4, 9]))
    want = [[greedy_token(r) for r in p] for p in parts]
    assert greedy_rows(parts) == want
    assert greedy_rows([p.clone() for p in parts]) == want  # separate tensors: one launch each
    assert greedy_rows(parts[::-1]) == want[::-1] and greedy_rows([]) == []
