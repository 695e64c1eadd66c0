import pytest

from deploy.config import TenantConfig
from specdec.errors import Overloaded, Unauthorized
from deploy.router.affinity import replica_of
from deploy.router.tenants import TenantRegistry, TokenBucket


def registry(**kw):
    return TenantRegistry([TenantConfig(name="a", api_key="key-aaaa-1", max_sessions=2, **kw),
                           TenantConfig(name="b", api_key="key-bbbb-1")])


def test_authentication_by_hashed_key():
    r = registry()
    assert r.authenticate("Bearer key-aaaa-1").config.name == "a"
    assert r.authenticate("bearer key-bbbb-1").config.name == "b"
    for bad in (None, "", "key-aaaa-1", "Bearer nope", "Basic key-aaaa-1"):
        with pytest.raises(Unauthorized):
            r.authenticate(bad)
    assert all(t.config.api_key is None for t in r.by_name.values())  # plain keys are not kept


def test_session_quota():
    r = registry()
    a = r.by_name["a"]
    for sid in ("s1", "s2"):
        r.admit_session(a)
        r.session_opened(a, sid)
        r.open_done(a)
    with pytest.raises(Overloaded) as e:
        r.admit_session(a)
    assert e.value.reason == "tenant_sessions"
    r.session_gone(a, "s1")
    r.admit_session(a)


def test_a_session_the_replica_closes_as_it_finishes_gives_its_slot_back():
    """close_on_finish: the finishing reply frees the slot (no close request comes); a session
    opened without it holds its slot until it is closed, finished or not."""
    r = registry()
    a = r.by_name["a"]
    for sid, closes in (("s1", True), ("s2", False)):
        r.admit_session(a)
        r.session_opened(a, sid, close_on_finish=closes)
        r.open_done(a)
    r.session_finished(a, "s2")
    with pytest.raises(Overloaded):
        r.admit_session(a)
    r.session_finished(a, "s1")
    r.admit_session(a)
    assert set(a.sessions) == {"s2"} and not a.closing_on_finish


def test_opens_in_flight_hold_their_quota_slot():
    """Issue 14 #7: the check and the insert were split by the verifier call, so 20
    concurrent opens all passed a quota of 8."""
    r = registry()
    a = r.by_name["a"]
    r.admit_session(a)
    r.admit_session(a)  # two opens waiting for the verifier
    with pytest.raises(Overloaded):
        r.admit_session(a)
    r.open_done(a)  # one failed: its slot is free again
    r.admit_session(a)


def test_token_rate_limit_and_retry_after():
    b = TokenBucket(rate=10.0, capacity=20.0)
    b.spend(30, now=b.stamp)
    assert b.wait_time(now=b.stamp) == pytest.approx(1.0, rel=1e-3)
    assert b.wait_time(now=b.stamp + 1.01) == 0.0
    r = registry(tokens_per_second=5.0, burst_tokens=5.0)
    a = r.by_name["a"]
    r.session_used(a, "s", 50)
    with pytest.raises(Overloaded) as e:
        r.check_rate(a)
    assert e.value.reason == "tenant_rate" and e.value.retry_after > 5


def test_replica_of_session_id():
    assert replica_of("abc123.deadbeef") == "abc123"
    assert replica_of("no-dot") is None


def test_sessions_idle_past_the_timeout_give_their_slots_back_and_used_ones_keep_them(monkeypatch):
    import deploy.router.tenants as tenants

    clock = [100.0]
    monkeypatch.setattr(tenants.clock, "monotonic", lambda: clock[0])
    r = TenantRegistry([TenantConfig(name="a", api_key="key-aaaa-1", max_sessions=3)], idle_timeout_s=10.0)
    a = r.by_name["a"]
    for sid in ("s1", "s2", "s3"):
        r.admit_session(a)
        r.session_opened(a, sid)
        r.open_done(a)
        clock[0] += 1.0
    r.session_used(a, "s1", 1)  # s1 used last: the oldest is now s2
    clock[0] = 112.5  # s2 (opened at 101) and s3 (102) are idle past 10 s; s1 (used at 103) is not
    r.admit_session(a)
    assert set(a.sessions) == {"s1"} and list(a.sessions) == ["s1"]
