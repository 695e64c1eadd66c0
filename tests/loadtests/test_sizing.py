"""Sizing arithmetic (loadtests/sizing.py): a user's offered rounds/s and users per replica."""

import pytest

from loadtests.sizing import UserLoad, replicas_needed, table, users_held


def test_a_generating_user_offers_one_round_per_cycle():
    u = UserLoad(draft_ms=10, rtt_ms=40, depth=4, server_ms=60, think_s=0.0)
    assert u.cycle_s == pytest.approx(0.14)
    assert u.rounds_per_s == pytest.approx(1 / 0.14)


def test_think_time_scales_the_offered_load_by_the_duty_cycle():
    u = UserLoad(draft_ms=10, rtt_ms=40, depth=4, server_ms=60, tokens_per_round=2.0, max_tokens=100, think_s=7.0)
    busy = 50 * 0.14  # 50 rounds of 140 ms
    assert u.rounds_per_s == pytest.approx(busy / (busy + 7.0) / 0.14)
    slower = UserLoad(draft_ms=35, rtt_ms=40, depth=4, server_ms=60, tokens_per_round=2.0, max_tokens=100, think_s=7.0)
    assert slower.rounds_per_s < u.rounds_per_s  # a Jetson-class drafter offers fewer rounds per second


def test_users_and_replicas():
    u = UserLoad(draft_ms=10, rtt_ms=40, depth=4, server_ms=60, think_s=0.0)  # ~7.14 rounds/s
    assert users_held(700, u, headroom=1.0) == 98
    assert users_held(700, u, headroom=0.5) == 49
    assert replicas_needed(1000, 700, u, headroom=0.7) == 15  # 69 users per replica
    assert "jetson-orin" in table(700, 300) and "rtx4090" in table(700, 300)
