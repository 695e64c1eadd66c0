"""Admission control (deploy/router/admission.py): shed before the queue, fairly, with adaptive Retry-After."""

import pytest

from specdec.errors import Overloaded
from deploy.router.admission import AdmissionControl, inflight_limit


def _fill(ac: AdmissionControl, tenant: str, n: int, now: float = 0.0) -> None:
    for _ in range(n):
        ac.check(tenant, now=now)
        ac.started(tenant)


def test_limit_in_batches():
    # one running + 3 queued batches of 8 on 2 replicas, under a ceiling of 512
    assert inflight_limit(512, 3, 8, 2) == 64
    assert inflight_limit(40, 3, 8, 2) == 40  # the ceiling in requests
    assert inflight_limit(512, None, 8, 2) == 512  # no batch cap
    assert inflight_limit(512, 3, 8, 1, batches_running=2) == 40  # pipeline stages run 2 batches at once
    assert inflight_limit(512, 3, 8, 2, router_replicas=4) == 16  # each router enforces its share
    assert inflight_limit(2, 0, 1, 1, router_replicas=4) == 1


def test_over_the_limit_sheds_at_once_with_retry_after():
    ac = AdmissionControl(limit=4, retry_after_s=2.0)
    _fill(ac, "a", 4)
    with pytest.raises(Overloaded) as e:
        ac.check("a", now=0.0)
    assert e.value.status == 429 and e.value.reason == "queue_full" and e.value.retry_after == 2.0
    ac.finished("a")
    ac.check("a", now=0.0)  # room again


def test_a_shed_429_is_freed_by_reference_counting_alone():
    """A 429 must leave no reference cycle (the raising frame holding its own exception): at
    1000 users each one was ~60 objects of cyclic garbage, the router's collector ran ~35 ms
    every 2 s, and every pause stops the router's event loop."""
    import gc
    import weakref

    ac = AdmissionControl(limit=1)
    _fill(ac, "a", 1)
    gc.disable()
    try:
        try:
            ac.check("a", now=0.0)
        except Overloaded as e:
            freed = weakref.ref(e)
        assert freed() is None
    finally:
        gc.enable()


def test_new_sessions_wait_before_running_ones():
    ac = AdmissionControl(limit=8)
    _fill(ac, "a", 4)
    with pytest.raises(Overloaded) as e:
        ac.check("a", "open", now=0.0)
    assert e.value.reason == "new_sessions_paused"
    ac.check("a", "verify", now=0.0)  # a running session's round still gets in


def test_weighted_share_at_the_limit():
    ac = AdmissionControl(limit=8, weights={"gold": 3.0, "bronze": 1.0})
    _fill(ac, "gold", 8)  # gold alone filled the limit
    with pytest.raises(Overloaded):
        ac.check("gold", now=0.0)
    # bronze's share with gold active is 8 * 1/4 = 2: it gets in up to that, over the limit
    _fill(ac, "bronze", 2)
    with pytest.raises(Overloaded):
        ac.check("bronze", now=0.0)
    assert ac.fair_share("gold") == 6 and ac.fair_share("bronze") == 2
    # gold over its share stays shed until it drops below 6 in flight
    for _ in range(2):
        ac.finished("gold")
    with pytest.raises(Overloaded):
        ac.check("gold", now=0.0)
    ac.finished("gold")
    ac.check("gold", now=0.0)
    assert ac.inflight <= 2 * ac.limit


def test_retry_after_backs_off_under_sustained_shedding_and_decays():
    """New sessions are told the adaptive Retry-After; a running session's shed round always the base
    one (the cap drains within batch times: a long one would stall its generation, issue 61)."""
    ac = AdmissionControl(limit=1, retry_after_s=1.0, max_retry_after_s=5.0, window_s=1.0)
    t = 0.0
    _fill(ac, "a", 1, now=t)  # the one slot stays busy
    seen, rounds = [], []
    for _ in range(8):
        for _ in range(10):
            with pytest.raises(Overloaded) as e:
                ac.check("a", "open", now=t)
        seen.append(e.value.retry_after)
        with pytest.raises(Overloaded) as e:
            ac.check("a", now=t)
        assert e.value.reason == "queue_full"
        rounds.append(e.value.retry_after)
        t += 1.1
    assert seen[0] == 1.0 and seen == sorted(seen) and seen[-1] == 5.0  # grew, capped
    assert rounds == [1.0] * 8 and ac.snapshot()["retry_after_s"] == 5.0
    ac.finished("a")
    for _ in range(20):  # shedding stopped: back to the base
        t += 1.1
        ac.check("a", now=t)
    assert ac.retry_after == 1.0
    assert ac.snapshot() == {"inflight": 0, "limit": 1, "max_limit": 1, "objective_s": None, "retry_after_s": 1.0}


def _window(ac: AdmissionControl, t: float, inflight: int, latency_s: float, n: int = 50) -> float:
    """One window: ``inflight`` requests held at once, then ``n`` verifies finishing in ``latency_s``."""
    for _ in range(min(inflight, ac.limit)):
        ac.check("a", now=t)
        ac.started("a")
    for _ in range(n):
        ac.started("a")
        ac.finished("a", latency_s)
    while ac.inflight:
        ac.finished("a")
    return t + 1.1


def test_latency_objective_shrinks_the_cap_when_the_p99_is_over_it():
    ac = AdmissionControl(limit=128, objective_s=1.0, window_s=1.0, horizon=1)
    t = _window(ac, 0.0, 128, 2.0)
    ac.check("a", now=t)  # a new window closes the last one
    assert ac.limit == 102  # p99 twice the objective: by at most a fifth per window
    t = _window(ac, t, 102, 1.05)
    ac.check("a", now=t)
    assert ac.limit == int(102 * 0.9 / 1.05)  # in proportion, with a margin
    for _ in range(40):  # far over it for long: floored at min_limit
        t = _window(ac, t, ac.limit, 5.0)
        ac.check("a", now=t)
    assert ac.limit == ac.min_limit == 4


def test_one_spike_among_good_windows_does_not_move_the_cap():
    ac = AdmissionControl(limit=64, objective_s=1.0, window_s=1.0, horizon=5)
    t = 0.0
    for _ in range(4):
        t = _window(ac, t, 10, 0.1)
        ac.check("a", now=t)
    t = _window(ac, t, 10, 5.0, n=1)  # one slow round (a stall of the shared machine)
    ac.check("a", now=t)
    assert ac.limit == 64
    for _ in range(5):  # slow for a whole horizon: now it shrinks
        t = _window(ac, t, 64, 3.0)
        ac.check("a", now=t)
    assert ac.limit < 64


def test_latency_objective_grows_the_cap_back_only_while_it_is_used():
    ac = AdmissionControl(limit=100, objective_s=1.0, window_s=1.0, horizon=1)
    t = _window(ac, 0.0, 100, 3.0)
    ac.check("a", now=t)
    assert ac.limit == 80
    t = _window(ac, t, 5, 0.1)  # fast, but the cap was not in use: no reason to raise it
    ac.check("a", now=t)
    assert ac.limit == 80
    for _ in range(30):  # fast and the cap in use: +10% a window, up to the static cap
        t = _window(ac, t, ac.limit, 0.1)
        ac.check("a", now=t)
    assert ac.limit == ac.max_limit == 100


def test_latency_objective_needs_enough_samples_and_none_means_static():
    ac = AdmissionControl(limit=64, objective_s=1.0, window_s=1.0)
    t = _window(ac, 0.0, 64, 9.0, n=5)  # 5 completions: too few to judge
    ac.check("a", now=t)
    assert ac.limit == 64
    static = AdmissionControl(limit=64, window_s=1.0)
    t = _window(static, 0.0, 64, 9.0)
    static.check("a", now=t)
    assert static.limit == 64


def test_refusal_asks_without_admitting_and_counts_a_shed_once():
    """The router's fast path asks before reading a body: a refusal is counted as shed (it drives the
    Retry-After), an answer of None admits nothing (check admits the parsed request later)."""
    ac = AdmissionControl(limit=4, retry_after_s=1.0)
    _fill(ac, "a", 2)
    assert ac.refusal("a", "verify", now=0.0) is None
    assert ac._admitted == 2  # only _fill's checks
    e = ac.refusal("a", "open", now=0.0)  # half the limit in flight: new sessions wait
    assert isinstance(e, Overloaded) and e.reason == "new_sessions_paused" and ac._shed == 1
    _fill(ac, "a", 2)
    e = ac.refusal("a", "verify", now=0.0)
    assert e.reason == "queue_full" and e.retry_after == 1.0 and ac._shed == 2
    # the same decision as check, which raises it
    with pytest.raises(Overloaded):
        ac.check("a", now=0.0)
    assert ac._shed == 3
    # a window with more than a quarter shed grows the Retry-After, whichever of the two counted
    assert ac.refusal("a", "open", now=1.5).retry_after == 1.5


def test_a_tenant_under_its_share_still_opens_sessions_while_new_sessions_wait():
    """New sessions wait while half the limit is in flight, except for a tenant under its weight's
    share of that half: it needs sessions to use its share (the fairness of point 2, for opens)."""
    ac = AdmissionControl(limit=16, weights={"gold": 3.0, "bronze": 1.0})
    _fill(ac, "bronze", 8)  # bronze alone holds half the limit
    with pytest.raises(Overloaded) as e:
        ac.check("bronze", "open", now=0.0)
    assert e.value.reason == "new_sessions_paused"
    for _ in range(5):  # gold's share of the half is 8 * 3/4 = 6
        ac.check("gold", "open", now=0.0)
        ac.started("gold")
    assert ac.fair_share("gold") / 2 == 6
    ac.check("gold", "open", now=0.0)
    ac.started("gold")
    with pytest.raises(Overloaded):
        ac.check("gold", "open", now=0.0)


def test_a_shed_round_pauses_new_sessions_for_a_window_and_then_they_open_again():
    """Running sessions first (point 3): while a tenant's running sessions' rounds are shed at the cap,
    a new session of its would only add rounds to shed, so its opens wait a window even with less than
    half the limit in flight (sessions waiting out a Retry-After hold no request in flight); a window
    after its last shed round they open again, whatever happened before (nothing to heal from outside)."""
    ac = AdmissionControl(limit=4, retry_after_s=1.0, window_s=1.0)
    _fill(ac, "a", 4, now=0.0)
    with pytest.raises(Overloaded) as e:
        ac.check("a", now=0.1)
    assert e.value.reason == "queue_full" and e.value.retry_after == 1.0
    for _ in range(4):
        ac.finished("a")
    assert ac.inflight == 0
    e = ac.refusal("a", "open", now=0.5)
    assert e.reason == "new_sessions_paused" and "rounds are being shed" in e.message
    assert ac.refusal("b", "open", now=0.5) is None  # another tenant's rounds were not shed
    assert ac.refusal("a", "open", now=1.2) is None  # a window after the shed round
    assert ac.refusal("a", "open", now=1000.0) is None  # and long after, with no request since
