"""Tenant shares under contention (sim/fairness.py): only forwards that leave two tenants waiting
count, each tenant's tokens over its weight; and a scheduler that ignores the weights fails the
fault run's invariant."""

from __future__ import annotations

import pytest

from deploy.verifier.scheduler import FairScheduler
from sim.fairness import TenantShares
from tests.sim.test_faults import run


def test_shares_count_only_forwards_that_leave_both_tenants_waiting():
    s = TenantShares({"gold": 3.0, "bronze": 1.0}, min_forwards=2)
    s.observe({"gold": 30, "bronze": 10}, {"gold": 2, "bronze": 1})
    s.observe({"gold": 30, "bronze": 10}, {"gold": 2, "bronze": 1})
    s.observe({"bronze": 400}, {"bronze": 5})  # gold had nothing waiting: not a contended forward
    assert s.ratios() == {"bronze/gold": {"forwards": 2, "ratio": pytest.approx(1.0)}}
    assert s.within(0.01)


def test_equal_tokens_to_tenants_weighted_three_to_one_is_a_third_of_their_share():
    s = TenantShares({"gold": 3.0, "bronze": 1.0}, min_forwards=1)
    s.observe({"gold": 20, "bronze": 20}, {"gold": 1, "bronze": 1})
    assert s.ratios()["bronze/gold"]["ratio"] == pytest.approx(1 / 3)
    assert not s.within(0.2)


def test_a_pair_seen_in_few_forwards_is_not_judged():
    s = TenantShares({"a": 1.0, "b": 1.0}, min_forwards=50)
    s.observe({"a": 10}, {"a": 1, "b": 1})
    assert s.ratios()["a/b"]["ratio"] == 0.0 and s.within(0.2)


def test_a_scheduler_that_ignores_the_weights_fails_the_fault_runs_invariant(monkeypatch):
    add = FairScheduler.add

    def unweighted(self, p):
        self.weights = {}
        add(self, p)

    monkeypatch.setattr(FairScheduler, "add", unweighted)
    out = run(0)
    assert out["tenant_shares"]["bronze/gold"]["ratio"] < 0.6
    assert out["invariants"]["tenant_shares_by_weight"] is False
