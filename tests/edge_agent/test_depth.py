"""Depth rules: fixed, server pacing hint, FlexSpec argmax, and their combination."""

from __future__ import annotations

import pytest

from edge_agent.depth import DepthPolicy, Telemetry, expected_tokens, flexspec_depth


def telemetry(rtt_ms=20.0, draft_ms=5.0, alpha=0.7, server_base=30.0, slope=0.0) -> Telemetry:
    t = Telemetry(ema=0.05)
    t.observe_rtt(rtt_ms / 1e3)  # the first observation sets an EMA
    t.observe_draft(draft_ms / 1e3)
    t.succ, t.fail = alpha, 1 - alpha
    for n in (4, 16, 32, 8, 24) * 20:
        t.observe_round(0, 0, n, rtt_ms + server_base + slope * n)
    return t


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.9, 3) > expected_tokens(0.9, 2)


def test_acceptance_ema_tracks_the_per_level_rate():
    t = Telemetry(ema=0.05)
    # every round: depth 4, accepts 2 levels then misses -> alpha = 2 / 3
    for _ in range(300):
        t.observe_round(4, 2, 16, 50.0)
    assert t.alpha == pytest.approx(2 / 3, abs=0.01)
    for _ in range(300):  # full acceptance pushes alpha up
        t.observe_round(4, 4, 16, 50.0)
    assert t.alpha > 0.95


def test_server_fit_recovers_base_and_slope():
    t = telemetry(rtt_ms=10, server_base=40.0, slope=0.5)
    base, slope = t.server_fit()
    assert base == pytest.approx(40.0, rel=0.05)
    assert slope == pytest.approx(0.5, rel=0.05)


def test_flexspec_goes_deeper_with_rtt_and_acceptance_and_shallower_with_draft_cost():
    base = flexspec_depth(telemetry(), 16)
    assert flexspec_depth(telemetry(rtt_ms=200.0), 16) > base  # T_fixed amortized over more tokens
    assert flexspec_depth(telemetry(alpha=0.95), 16) > base
    assert flexspec_depth(telemetry(alpha=0.2), 16) < base
    assert flexspec_depth(telemetry(draft_ms=40.0), 16) < base
    assert flexspec_depth(telemetry(slope=5.0), 16) < base  # a slow link / costly nodes
    assert 1 <= flexspec_depth(telemetry(alpha=0.999, rtt_ms=1e4), 6) <= 6


def test_flexspec_is_the_argmax_of_its_objective():
    t = telemetry(rtt_ms=35.0, draft_ms=7.0, alpha=0.75, server_base=20.0, slope=0.2)
    base, slope = t.server_fit()
    rate = {k: expected_tokens(t.alpha, k) / (35.0 + base + k * (7.0 + slope * 4.0)) for k in range(1, 13)}
    assert flexspec_depth(t, 12, nodes_per_level=4.0) == max(rate, key=rate.get)


def test_policies_and_their_combination():
    t = telemetry(rtt_ms=200.0, alpha=0.9)
    k_flex = flexspec_depth(t, 12)
    assert DepthPolicy("fixed", depth=3).choose(t, hint=9, rounds=5) == 3
    assert DepthPolicy("server", depth=3).choose(t, hint=9, rounds=5) == 9
    assert DepthPolicy("server", depth=3).choose(t, hint=0, rounds=5) == 3  # no hint: fallback
    assert DepthPolicy("flexspec").choose(t, hint=2, rounds=5) == k_flex  # ignores the server
    assert DepthPolicy("auto").choose(t, hint=2, rounds=5) == min(k_flex, 2)  # the hint caps it
    assert DepthPolicy("auto").choose(t, hint=0, rounds=5) == k_flex
    assert DepthPolicy("auto", depth=4).choose(t, hint=0, rounds=0) == 4  # nothing measured yet
    assert DepthPolicy("server", max_depth=6).choose(t, hint=50, rounds=1) == 6
    with pytest.raises(ValueError):
        DepthPolicy("bogus")
