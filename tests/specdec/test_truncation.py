"""Server-side truncation at batch time: which prefix of each tree one forward verifies."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.truncation import (GainCalibration, choose_prefixes, decode_confidence, encode_confidence,
                                        node_gains)


def flat_then_linear(flat_rows: int, per_row: float, base: float = 0.02):
    return lambda rows: base + per_row * max(0, rows - flat_rows)


def test_memory_bound_verifies_everything_compute_bound_verifies_less():
    gains = [[0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.05, 0.02]] * 16
    free = choose_prefixes(gains, flat_then_linear(1024, 0.0))
    steep = choose_prefixes(gains, flat_then_linear(16, 0.002))
    assert free == [8] * 16
    assert sum(steep) < sum(free) and all(0 <= n <= 8 for n in steep)


@pytest.mark.parametrize("slope", [0.0005, 0.001, 0.002, 0.004])
def test_a_steeper_cost_curve_never_chooses_more_nodes(slope):
    gains = [[0.95 ** (j + 1) * (0.9 ** s) for j in range(16)] for s in range(8)]
    a = choose_prefixes(gains, flat_then_linear(8, slope))
    b = choose_prefixes(gains, flat_then_linear(8, 2 * slope))
    assert sum(b) <= sum(a)


def test_rows_already_in_the_batch_leave_less_room():
    gains = [[0.9, 0.5, 0.3, 0.1]] * 4
    cost = flat_then_linear(24, 0.004)
    assert sum(choose_prefixes(gains, cost, base_rows=20)) < sum(choose_prefixes(gains, cost))


def test_the_best_nodes_go_first_across_sessions():
    # session 0's drafts are confident, session 1's are not: the budget goes to session 0
    got = choose_prefixes([[0.9, 0.85, 0.8], [0.1, 0.05, 0.01]], flat_then_linear(2, 0.002, base=0.01))
    assert got[0] > got[1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(0, 1), max_size=12), min_size=1, max_size=8),
       st.integers(0, 64), st.floats(0, 0.01), st.integers(0, 32))
def test_the_choice_is_the_best_prefix_set(raw, flat, slope, base_rows):
    """Exhaustive check for small cases: no other prefix choice has a better rate."""
    gains = [sorted(g, reverse=True) for g in raw]
    cost = flat_then_linear(flat, slope)
    take = choose_prefixes(gains, cost, base_rows)
    assert all(0 <= n <= len(g) for n, g in zip(take, gains))

    def rate(t):
        return (len(gains) + sum(sum(g[:n]) for g, n in zip(gains, t))) / cost(base_rows + len(gains) + sum(t))

    best = rate(take)
    total = sum(len(g) for g in gains)
    for k in range(total + 1):  # the best k nodes overall is the best set of size k (gains sorted)
        pool = sorted(((g[j], s, j) for s, g in enumerate(gains) for j in range(len(g))), reverse=True)[:k]
        t = [0] * len(gains)
        for _, s, _ in pool:
            t[s] += 1
        assert rate(t) <= best + 1e-9


def test_confidence_byte_round_trip_and_prior():
    for p in (1.0, 0.5, 0.1, 1e-3):
        assert decode_confidence(encode_confidence(math.log(p))) == pytest.approx(p, rel=0.04)
    assert encode_confidence(-100.0) == 255 and encode_confidence(float("nan")) == 0
    g = node_gains([-1, 0, -1, 1], alpha=0.5)  # depths 1, 2, 1, 3
    assert g == [0.5, 0.25, 0.25, 0.125]
    assert node_gains([-1, 0], conf=[encode_confidence(math.log(0.2)), 0]) == pytest.approx([0.2, 0.2], rel=0.04)
    assert node_gains([5, 7, -3]) == [0.6, 0.6, 0.6]  # malformed parents: no error here


def test_calibration_scales_over_confident_drafts_down():
    c = GainCalibration(ema=0.5)
    for _ in range(10):
        c.observe(predicted=4.0, accepted=1)
    assert c.factor < 0.4 and c.scale([0.8])[0] < 0.35
