"""Eviction policy: per-tenant quotas first, then the replica budget by fair share, then LRU."""

from deploy.verifier.eviction import Limits, SessionUse, choose_victims


def uses(spec):
    """spec: [(tenant, kv_tokens)] in LRU order (oldest first)."""
    return [SessionUse(f"{t}{i}", t, kv, float(i)) for i, (t, kv) in enumerate(spec)]


def limits(budget=1000, sessions=100, quotas=None, weights=None):
    return Limits(budget, sessions, quotas or {}, weights or {})


def test_nothing_to_do_within_limits():
    assert choose_victims(uses([("a", 100), ("b", 100)]), limits()) == []


def test_a_tenant_over_its_quota_loses_its_own_oldest_sessions():
    s = uses([("b", 16), ("a", 32), ("a", 32), ("a", 32)])
    assert choose_victims(s, limits(quotas={"a": 64})) == ["a1"]


def test_over_budget_the_tenant_over_its_fair_share_goes_first_even_if_others_are_older():
    s = uses([("b", 100), ("b", 100), ("a", 300), ("a", 300), ("a", 300)])  # 1100 > 1000; a holds 900 > 500
    assert choose_victims(s, limits()) == ["a2"]


def test_weights_set_the_fair_share():
    s = uses([("a", 300), ("b", 300), ("b", 300), ("a", 300)])  # 1200; b's weight 3: share 750 > 600
    assert choose_victims(s, limits(weights={"b": 3.0})) == ["a0"]


def test_plain_lru_when_no_tenant_is_over_its_share_and_protected_sessions_stay():
    s = uses([("a", 400), ("b", 400), ("c", 300)])  # shares 333: a and b over -> a0 first (oldest)
    assert choose_victims(s, limits()) == ["a0"]
    assert choose_victims(s, limits(), protect=frozenset({"a0"})) == ["b1"]
    assert choose_victims(uses([("a", 600), ("a", 600)]), limits(), protect=frozenset({"a0", "a1"})) == []


def test_the_session_count_limit():
    s = uses([("a", 1), ("a", 1), ("b", 1)])
    assert choose_victims(s, limits(sessions=2)) == ["a0"]


def test_within_limits_only_when_choose_victims_has_nobody_to_evict():
    import random

    from deploy.verifier.eviction import within_limits

    rng = random.Random(1)
    for _ in range(500):
        spec = [(rng.choice("ab"), 16 * rng.randrange(1, 20)) for _ in range(rng.randrange(0, 12))]
        lim = limits(budget=rng.randrange(0, 1500), sessions=rng.randrange(0, 12),
                     quotas={"a": 200} if rng.random() < 0.3 else None)
        s = uses(spec)
        if within_limits(lim, len(s), sum(u.kv_tokens for u in s)):
            assert choose_victims(s, lim) == []
        elif not lim.quotas:
            assert choose_victims(s, lim)  # over a limit, without quotas: someone goes
