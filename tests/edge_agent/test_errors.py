"""Error mapping: the server's JSON errors back to the typed errors of :mod:`specdec.errors`."""

from __future__ import annotations

import pytest

from specdec import errors as E
from edge_agent.errors import error_from_json


@pytest.mark.parametrize("status,code,cls", [(410, "session_evicted", E.SessionEvicted),
                                             (404, "session_not_found", E.SessionNotFound),
                                             (401, "unauthorized", E.Unauthorized),
                                             (409, "prefix_mismatch", E.PrefixMismatch),
                                             (400, "invalid_tree", E.InvalidTree)])
def test_error_codes_map_back_to_typed_errors(status, code, cls):
    e = error_from_json(status, {"error": {"code": code, "message": "m", "extra": 1}})
    assert type(e) is cls and e.message == "m" and e.details == {"extra": 1}


def test_overloaded_keeps_retry_after_and_unknown_codes_keep_status():
    e = error_from_json(429, {"error": {"code": "overloaded", "message": "busy"}}, retry_after=3.0)
    assert isinstance(e, E.Overloaded) and e.retry_after == 3.0
    e = error_from_json(429, {"error": {"code": "overloaded", "message": "busy", "retry_after": 0.5}})
    assert e.retry_after == 0.5
    e = error_from_json(418, None)
    assert isinstance(e, E.SpecError) and e.status == 418 and e.code == "http_418"
