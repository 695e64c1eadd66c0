"""A replica's own figures over a window (deploy/verifier/stats_window.py), from two snapshots of its counters."""

from __future__ import annotations

import pytest

from deploy.verifier.counters import ReplicaCounters
from deploy.verifier.stats_window import mean_figures, window_figures
from specdec import clock
from specdec.engine import ForwardStats


class Tick:
    def __init__(self):
        self.t = 100.0

    def monotonic(self):
        return self.t

    def wall(self):
        return self.t

    def blocking_sleep(self, s):
        self.t += s

    def thread_time(self):
        return 0.0


def test_what_happened_between_two_snapshots_and_nothing_before():
    with clock.use(Tick()) as t:
        c = ReplicaCounters()
        c.on_forward(ForwardStats("verify", 9, 99, 1.0, cpu_seconds=9.0))  # before the window: not counted
        c.on_request(7.0)
        before = c.to_dict()
        t.t += 2.0
        c.on_forward(ForwardStats("verify", 3, 12, 0.020, cpu_seconds=0.010))
        c.on_forward(ForwardStats("prefill", 1, 64, 0.050, cpu_seconds=0.040))  # a prompt's: not a verify forward
        c.on_forward(ForwardStats("verify", 5, 20, 0.030, cpu_seconds=0.014))
        for s in (0.010, 0.020, 0.030):
            c.on_request(s)
        f = window_figures(before, c.to_dict())
    assert f == pytest.approx({"verify_forwards_per_s": 1.0, "sessions_per_forward": 4.0, "rows_per_forward": 16.0,
                               "forward_cpu_ms": 12.0, "round_ms_mean": 20.0})


def test_no_figures_without_a_round_and_a_forward_and_replicas_averaged():
    c = ReplicaCounters()
    snap = c.to_dict()
    assert window_figures(snap, c.to_dict()) is None  # nothing happened
    c.on_forward(ForwardStats("verify", 1, 2, 0.01))
    assert window_figures(snap, c.to_dict()) is None  # a forward but no round answered
    a = {"round_ms_mean": 10.0, "forward_cpu_ms": 1.0}
    assert mean_figures([a, None, {"round_ms_mean": 20.0, "forward_cpu_ms": 3.0}]) == {"round_ms_mean": 15.0,
                                                                                        "forward_cpu_ms": 2.0}
    assert mean_figures([None]) is None and mean_figures([]) is None
