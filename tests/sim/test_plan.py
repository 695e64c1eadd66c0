"""sim/plan.py: the planner's search for the most users one replica serves within the SLOs, and a
real (small) plan end to end: its replica counts follow from that capacity and the capacity point
meets every SLO."""

from __future__ import annotations

import math

import pytest

from deploy.config import AppConfig
from sim.cost_profile import CostProfile
from sim.plan import Slo, per_replica, plan
from sim.workload import Workload
from tests.sim.test_cost_profile import _profile

SLO = Slo(ttft_p99_ms=2000.0, itl_p99_ms=80.0, verify_p99_ms=500.0)
APP = {"target": {"model": "tiny-random", "dtype": "float32"}, "verifier": {"num_replicas": 1, "max_batch_sessions": 8}}


def _summary(itl_p99_ms: float, shed: float = 0.0) -> dict:
    return {"ttft_ms_p99": 100.0, "itl_ms": {"p50": 10.0, "p99": itl_p99_ms}, "verify_ms": {"p50": 10.0, "p99": 50.0},
            "shed_fraction": shed, "shed_429": 0, "diverged_rounds": 0, "errors": 0, "verified_tokens_per_s": 1.0,
            "verify_rounds_per_s": 1.0, "tokens_per_round": 1.0, "ttft_ms_mean": 50.0}


@pytest.fixture
def fake_simulate(monkeypatch):
    """A stand-in for the simulation (unit test of the search): ``curve(users) -> summary``."""
    seen = []

    def use(curve):
        def simulate(app, profile, workload, seed):
            seen.append(workload.users)
            return curve(workload.users)

        monkeypatch.setattr("sim.__main__.simulate", simulate)
        return seen

    return use


def test_the_search_goes_past_light_loads_that_miss_until_one_passes(fake_simulate):
    """Lone sessions may draft deeper than a loaded replica lets them: ITL p99 can fall with load.
    Capacity here is 40 (ITL misses below 16 users and above 40)."""
    seen = fake_simulate(lambda n: _summary(120.0 if n < 16 or n > 40 else 50.0))
    cap, out, points = per_replica(AppConfig(**APP), None, Workload(), SLO, 0, hi=1000)
    assert 38 <= cap <= 40 and out["itl_ms"]["p99"] == 50.0
    assert seen[:3] == [8, 16, 32] and len(points) == len(seen)


def test_the_search_stops_where_the_replica_sheds_before_any_point_passed(fake_simulate):
    seen = fake_simulate(lambda n: _summary(120.0, shed=0.5 if n >= 32 else 0.0))
    cap, out, _ = per_replica(AppConfig(**APP), None, Workload(), SLO, 0, hi=100_000)
    assert (cap, out) == (0, None) and seen == [8, 16, 32, 4, 2, 1]  # then below the start; none twice


def test_a_small_plan_end_to_end():
    """Tiny target, synthetic profile, a few users: the replicas per user count are the count over
    the capacity found, and the simulation at capacity meets every SLO."""
    profile = CostProfile.fit(_profile(model="tiny-random", dtype="float32"), "synthetic")
    w = Workload(users=8, duration_s=6.0, warmup_s=2.0, max_tokens=16, think_s=(0.5, 1.0),
                 network={"rtt_ms": 30.0})
    p = plan(AppConfig(**APP), profile, w, Slo(2000.0, 400.0, 1000.0), users=[10, 100], seed=0)
    for mode in ("edge", "server_ar"):
        m = p["modes"][mode]
        cap = m["users_per_replica"]
        assert cap >= 8, (mode, m["points"])
        assert [r["replicas"] for r in m["by_users"]] == [math.ceil(10 / cap), math.ceil(100 / cap)]
        assert Slo(2000.0, 400.0, 1000.0).misses(m["at_capacity"]) == []


def test_a_point_is_judged_on_its_figures_mean_over_the_seeds(fake_simulate):
    """A p99 over one short run is a handful of samples: each point is simulated with ``seeds``
    seeds, its SLO figures averaged (one seed's bad luck no longer decides the point) and a lossless
    failure of any seed kept."""
    from sim.plan import over_seeds

    calls = []

    def curve(n):
        calls.append(n)
        return _summary(60.0 if len(calls) % 2 else 120.0)  # seeds alternate: mean 90 > 80, misses

    fake_simulate(curve)
    cap, _, points = per_replica(AppConfig(**APP), None, Workload(), SLO, 0, hi=8, seeds=2)
    assert cap == 0 and calls[:2] == [8, 8] and len(calls) == 2 * len(points)  # every point twice, none again
    assert points[0][1]["itl_ms"]["p99"] == 90.0 and points[0][1]["seeds"] == 2
    bad = over_seeds([_summary(50.0), {**_summary(50.0), "diverged_rounds": 1}])
    assert bad["diverged_rounds"] == 1 and SLO.misses(bad) == ["lossless"]
