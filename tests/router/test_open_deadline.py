"""deploy/router/open_deadline.py: an open's deadline from its header, capped by the router's."""

import pytest

from deploy.router.open_deadline import request_deadline


@pytest.mark.parametrize("header,expected", [(None, 5.0), ("2", 2.0), ("0.5", 0.5), ("60", 5.0)])
def test_request_deadline(header, expected):
    assert request_deadline(header, 5.0) == expected


@pytest.mark.parametrize("header", ["0", "-1", "nan", "abc", ""])
def test_bad_deadline_header_is_a_value_error(header):
    with pytest.raises(ValueError, match="x-open-deadline-s must be a positive number"):
        request_deadline(header, 5.0)
