"""A verify frame's variable sections (specdec/frame_sections.py) on their own."""

from __future__ import annotations

import pytest

from specdec.errors import InvalidRequest
from specdec.frame_sections import decode_proposals, decode_rule, encode_proposals, encode_rule


def test_a_rule_section_round_trips_and_a_bad_name_is_refused():
    data = b"xx" + encode_rule("toy", b"\x00\x01")
    assert decode_rule(data, 2) == ("toy", b"\x00\x01", len(data) - 2)
    with pytest.raises(InvalidRequest, match="F_RULE"):
        decode_rule(b"xx" + encode_rule("toy", b"")[:-1], 2)  # its name cut short
    with pytest.raises(InvalidRequest, match="F_RULE"):
        decode_rule(b"\x02\x00\x00\x00\x00\xff\xfe", 0)  # not ASCII


def test_proposals_round_trip_with_their_size():
    props = [((1, 2), (3, 4)), ((), ()), ((7,), (1,))]
    data = encode_proposals(props, 2)
    assert decode_proposals(data, 0, 2) == (props, len(data))
