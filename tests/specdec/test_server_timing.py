"""specdec/server_timing.py: the router's time of a round in a Server-Timing header, read back."""

from __future__ import annotations

import pytest

from specdec.server_timing import METRIC, header_value, router_ms


def test_the_routers_time_reads_back_in_milliseconds():
    assert router_ms(header_value(0.0123456)) == pytest.approx(12.35)
    assert router_ms(header_value(0.0)) == 0.0


def test_the_router_metric_is_found_among_others_with_any_spacing_and_params():
    assert router_ms(f'cache;desc="hit", {METRIC} ; desc="the router" ; dur = 7.5, db;dur=3') == 7.5
    assert router_ms(f'{METRIC};dur="4.25"') == 4.25  # a quoted value, as the grammar allows


@pytest.mark.parametrize("value", [None, "", "db;dur=3", f"{METRIC}", f"{METRIC};desc=x", f"{METRIC};dur=abc",
                                   f"{METRIC};dur=-1", f"{METRIC};dur=nan", f"{METRIC};dur=inf", "routerx;dur=3"])
def test_no_router_time_or_a_bad_one_reads_none(value):
    assert router_ms(value) is None
