"""The rule registry (specdec/rules.py) and a registered rule's frame (F_RULE)."""

from __future__ import annotations

import pytest

from specdec.errors import InvalidRequest
from specdec.protocol import F_CHAIN, F_CONF, VerifyFrame
from specdec.rules import RuleRegistry, import_rule_modules


def test_a_name_is_registered_once_and_an_unknown_one_is_a_400_naming_the_rules():
    r = RuleRegistry("verifier")
    a = r.register("a", object())
    assert r.get("a") is a and r.register("a", a) is a  # registering the same object again is harmless
    with pytest.raises(ValueError, match="already has a rule 'a'"):
        r.register("a", object())
    with pytest.raises(InvalidRequest, match=r"unknown verify rule 'b': the verifier has \['a'\]"):
        r.get("b")
    with pytest.raises(ValueError):
        r.register("", object())


def test_a_rule_module_that_cannot_be_imported_is_named():
    with pytest.raises(ValueError, match="no_such_rule_module"):
        import_rule_modules(["no_such_rule_module"])


def test_a_registered_rules_frame_carries_its_name_and_payload_and_nothing_else():
    f = VerifyFrame(7, [3, 4], [-1, 0], rule="toy", payload=b"\x01\x02")
    g = VerifyFrame.decode(f.encode())
    assert (g.rule, g.payload, g.rule_name, g.tokens, g.parents) == ("toy", b"\x01\x02", "toy", [3, 4], [-1, 0])
    assert VerifyFrame(7, [3], [-1]).rule_name == "match"
    assert VerifyFrame(7, [3], [-1], q=[0.5]).rule_name == "rejection"
    data = bytearray(f.encode())
    data[3] |= F_CHAIN  # one rule a frame
    with pytest.raises(InvalidRequest, match="one rule a frame"):
        VerifyFrame.decode(bytes(data))
    data = bytearray(f.encode())
    data[3] |= F_CONF  # a registered rule carries its options in its payload
    with pytest.raises(InvalidRequest, match="not options of the registered rule"):
        VerifyFrame.decode(bytes(data))
    with pytest.raises(InvalidRequest):
        VerifyFrame.decode(f.encode()[:-3])  # its payload cut short
