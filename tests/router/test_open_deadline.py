"""deploy/router/open_deadline.py: opens shed at the door when the prefill queue predicts a late first token."""

import pytest

from specdec.errors import Overloaded
from deploy.router.open_deadline import PrefillForecast, deadline_refusal, request_deadline


def test_no_rate_admits_everything():
    f = PrefillForecast()
    assert f.refusal(10_000, 0.1) is None


def test_queue_over_rate_past_the_deadline_is_shed():
    f = PrefillForecast()
    work = f.started(1000)
    f.finished(1000, work, 1.0)  # 1000 tokens/s measured
    assert f.rate == pytest.approx(1000.0)
    f.started(3000)  # 3 s of prefill queued
    assert f.refusal(1000, 5.0) is None  # 4 s: admitted
    e = f.refusal(2500, 5.0)  # 5.5 s: shed
    assert isinstance(e, Overloaded) and e.status == 429 and e.reason == "open_deadline"
    assert e.retry_after >= 1.0 and f.shed == 1


def test_rate_sample_counts_the_queue_ahead():
    f = PrefillForecast(alpha=1.0)
    f.started(500)
    work = f.started(500)  # 1000 tokens ahead of its first token, its own included
    f.finished(500, work, 2.0)
    assert f.rate == pytest.approx(500.0) and f.queued_tokens == 500


def test_failed_open_leaves_the_queue_without_a_rate_sample():
    f = PrefillForecast()
    work = f.started(100)
    f.finished(100, work, None)
    assert f.queued_tokens == 0 and f.rate is None


@pytest.mark.parametrize("header,expected", [(None, 5.0), ("2", 2.0), ("0.5", 0.5), ("60", 5.0)])
def test_request_deadline(header, expected):
    assert request_deadline(header, 5.0) == expected


@pytest.mark.parametrize("header", ["0", "-1", "nan", "abc", ""])
def test_bad_deadline_header_is_a_value_error(header):
    with pytest.raises(ValueError):
        request_deadline(header, 5.0)


def test_deadline_refusal_is_a_429():
    e = deadline_refusal(5.0, 2.0)
    assert e.status == 429 and e.retry_after == 2.0 and e.reason == "open_deadline_passed"
