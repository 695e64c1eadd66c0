"""deploy/prefill_forecast.py: opens refused only for the work queued ahead of them, a cost model
that one outlier cannot bend, and a forecast that heals without outside help (issue 67)."""

import pytest

from deploy.prefill_forecast import OpenSample, PrefillCost, PrefillForecast, deadline_refusal, fit_cost
from specdec.errors import Overloaded


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def answered(f: PrefillForecast, clock: Clock, tokens: int, seconds: float) -> None:
    """One open admitted alone and answered ``seconds`` later."""
    ticket = f.started(tokens)
    clock.t += seconds
    f.finished(ticket, measured=True)


def test_an_idle_server_admits_any_open_whatever_it_measured():
    clock = Clock()
    f = PrefillForecast(clock=clock)
    answered(f, clock, 2, 3.0)  # a cold first open: 1.5 s a token if it were all per-token cost
    assert f.refusal(0.01) is None  # nothing queued ahead: never refused, whatever its own size
    assert f.shed == 0 and f.predicted_wait() == 0.0


def test_only_the_queue_ahead_counts_against_the_deadline():
    clock = Clock()
    f = PrefillForecast(clock=clock)
    for tokens in (100, 400, 1000, 200):
        answered(f, clock, tokens, 0.05 + 0.001 * tokens)
    assert f.cost.fixed == pytest.approx(0.05) and f.cost.per_token == pytest.approx(0.001)
    f.started(3000)  # 3.05 s of prefill queued ahead
    assert f.predicted_wait() == pytest.approx(3.05)
    assert f.refusal(3.1) is None  # admitted: its own prefill (of any length) comes on top
    f.started(2000)  # 5.1 s ahead now
    e = f.refusal(5.0)
    assert isinstance(e, Overloaded) and e.status == 429 and e.reason == "open_deadline"
    assert e.retry_after >= 1.0 and f.shed == 1 and "5.1 s" in str(e)


def test_a_sample_counts_the_queue_it_waited_for():
    clock = Clock()
    f = PrefillForecast(clock=clock)
    f.started(500)
    ticket = f.started(500)
    assert (ticket.opens, ticket.tokens) == (2, 1000)
    clock.t += 2.0
    f.finished(ticket, measured=True)
    assert f.cost.samples[-1] == OpenSample(2, 1000, 2.0)
    assert (f.queued_opens, f.queued_tokens) == (1, 500)


def test_a_failed_open_leaves_the_queue_without_a_sample():
    f = PrefillForecast()
    f.finished(f.started(100), measured=False)
    assert (f.queued_opens, f.queued_tokens) == (0, 0) and not f.cost.known


def test_the_fit_ignores_one_outlier():
    exact = [OpenSample(1, t, 0.02 + 0.0005 * t) for t in (32, 64, 128, 256, 300, 500, 800, 1000)]
    for outlier in (OpenSample(1, 2, 3.0), OpenSample(1, 1000, 60.0), OpenSample(3, 96, 0.001)):
        fixed, per_token = fit_cost([outlier] + exact)
        assert fixed == pytest.approx(0.02, rel=0.05) and per_token == pytest.approx(0.0005, rel=0.05)


def test_below_three_samples_the_cheapest_stands():
    assert fit_cost([OpenSample(1, 2, 3.0), OpenSample(1, 2, 0.05)]) == (pytest.approx(0.05), 0.0)
    fixed, per_token = fit_cost([OpenSample(1, 100, 0.2), OpenSample(1, 300, 0.4)])
    assert fixed == pytest.approx(0.1) and per_token == pytest.approx(0.001)
    assert fit_cost([]) == (0.0, 0.0)


def test_same_sized_opens_are_all_fixed_cost():
    fixed, per_token = fit_cost([OpenSample(1, 2, 0.04 + 0.001 * i) for i in range(25)])
    assert per_token == 0.0 and fixed == pytest.approx(0.052)


def test_the_window_forgets_old_samples():
    c = PrefillCost(window=4)
    for _ in range(4):
        c.observe(OpenSample(1, 100, 10.0))
    for _ in range(4):
        c.observe(OpenSample(1, 100, 0.1))
    assert len(c.samples) == 4 and c.predict(1, 100) == pytest.approx(0.1)


@pytest.mark.parametrize("bad", [1, 3])
def test_a_pathological_estimate_heals_within_retry_after_while_opens_keep_coming(bad):
    """Every open is refused by an estimate 1000x too high (``bad`` samples of it); one probe per
    retry_after_s gets through and its sample counts: after ``bad + 1`` probes the median (or,
    below three samples, the cheapest) is the real cost, and opens are admitted again."""
    clock = Clock()
    f = PrefillForecast(retry_after_s=1.0, clock=clock)
    for _ in range(bad):
        answered(f, clock, 100, 100.0)
    blocker = f.started(100)  # one open in flight, so the estimate applies
    healed_after = None
    for step in range(1, 400):  # an open every 50 ms
        clock.t += 0.05
        probes = f.probes
        if f.refusal(0.5) is None:
            if f.probes == probes:  # admitted by the forecast itself, not as a probe
                healed_after = step * 0.05
                break
            answered(f, clock, 100, 0.1)  # the probe's real cost
    f.finished(blocker, measured=False)
    assert healed_after is not None and healed_after <= (bad + 1) * 1.0 + 0.5, (healed_after, f.state())
    assert 1 <= f.probes <= bad + 1 and f.shed > 0


def test_a_probe_is_let_through_at_most_once_per_retry_after():
    clock = Clock()
    f = PrefillForecast(retry_after_s=2.0, clock=clock)
    answered(f, clock, 10, 50.0)
    f.started(10)
    assert isinstance(f.refusal(1.0), Overloaded)  # one was admitted just now
    clock.t += 2.0
    assert f.refusal(1.0) is None and f.probes == 1  # none admitted for 2 s: a probe
    f.started(10)
    assert isinstance(f.refusal(1.0), Overloaded)
    clock.t += 1.9
    assert isinstance(f.refusal(1.0), Overloaded)
    clock.t += 0.2
    assert f.refusal(1.0) is None and f.probes == 2


def test_deadline_refusal_is_a_429():
    e = deadline_refusal(5.0, 2.0)
    assert e.status == 429 and e.retry_after == 2.0 and e.reason == "open_deadline_passed"
