from collections import Counter

import pytest

from deploy.verifier.scheduler import FairScheduler, Pending


def test_fifo_within_limits():
    s = FairScheduler()
    for i in range(5):
        s.add(Pending("t", f"s{i}", 10))
    batch = s.take(max_sessions=3, max_tokens=1000)
    assert [p.session_id for p in batch] == ["s0", "s1", "s2"]
    assert len(s) == 2


def test_token_budget_and_one_request_per_session():
    s = FairScheduler()
    s.add(Pending("t", "a", 30))
    s.add(Pending("t", "a", 30))  # second round of the same session waits for the next forward
    s.add(Pending("t", "b", 30))
    s.add(Pending("t", "c", 50))
    batch = s.take(max_sessions=10, max_tokens=70)
    assert [p.session_id for p in batch] == ["a", "b"]
    assert [p.session_id for p in s.take(10, 1000)] == ["a", "c"]


def test_oversized_request_still_runs_alone():
    s = FairScheduler()
    s.add(Pending("t", "big", 500))
    assert [p.session_id for p in s.take(4, 100)] == ["big"]


@pytest.mark.parametrize("weights", [{"a": 1, "b": 1}, {"a": 3, "b": 1}, {"a": 1, "b": 4}])
def test_saturated_share_follows_weights(weights):
    s = FairScheduler(weights=weights)
    served = Counter()
    for rnd in range(400):
        for t in weights:  # both tenants always have more pending than fits
            while s.pending_by_tenant().get(t, 0) < 8:
                s.add(Pending(t, f"{t}-{rnd}-{s.pending_by_tenant().get(t, 0)}", 10))
        for p in s.take(max_sessions=4, max_tokens=10_000):
            served[p.tenant] += p.tokens
    total = sum(served.values())
    for t, w in weights.items():
        assert served[t] / total == pytest.approx(w / sum(weights.values()), rel=0.05)


def test_returning_tenant_gets_no_backlog_credit():
    s = FairScheduler(weights={"a": 1, "b": 1})
    for i in range(100):
        s.add(Pending("a", f"a{i}", 10))
        s.take(1, 100)
    for i in range(10):
        s.add(Pending("a", f"a-late{i}", 10))
        s.add(Pending("b", f"b{i}", 10))
    first = s.take(10, 10_000)
    assert Counter(p.tenant for p in first) == {"a": 5, "b": 5}
