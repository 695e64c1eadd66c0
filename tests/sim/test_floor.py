"""sim/floor.py: the bare rounds it times are real rounds in virtual time (RTT, then a forward that
batches every waiting request)."""

from __future__ import annotations

import pytest

from sim.floor import measure


def test_a_lone_user_takes_an_rtt_and_a_forward_a_round():
    f = measure(users=1, replicas=1, rounds=10, rtt_s=0.04, forward_s=0.02)
    assert (f.rounds, f.forwards) == (10, 10)
    assert f.simulated_s == pytest.approx(10 * (0.04 + 0.02))


def test_users_waiting_together_share_a_forward():
    f = measure(users=97, replicas=1, rounds=5, rtt_s=0.04, forward_s=0.2)  # a forward outlasts a round trip
    assert f.rounds == 97 * 5
    assert f.forwards < f.rounds / 10
    assert f.simulated_s < f.rounds * 0.2 / 10
    assert f.wall_for(f.rounds) == pytest.approx(f.wall_s)
