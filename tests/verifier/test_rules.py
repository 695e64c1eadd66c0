"""The verifier's rules (deploy/verifier/rules.py): the request each built-in rule makes of a frame,
the gains it offers truncation, its reply."""

from __future__ import annotations

import pytest

from deploy.verifier.rules import RULES
from specdec.engine import ChainVerifyRequest, VerifyRequest
from specdec.errors import InvalidRequest
from specdec.protocol import VerifyFrame


def test_each_built_in_rule_makes_its_engine_request():
    tree = VerifyFrame(5, [1, 2, 3], [-1, 0, 0], conf=[200, 100, 50])
    match = RULES.get(tree.rule_name)
    req = match.request("s", tree, early=False)
    assert isinstance(req, VerifyRequest) and req.proposals is None and len(match.gains(tree)) == 3
    props = [((1,), (1,)), ((2,), (1,)), (), ()]
    sampled = VerifyFrame(5, [1, 2, 3], [-1, 0, 0], proposals=props)
    rule = RULES.get(sampled.rule_name)
    assert rule.request("s", sampled, early=False).proposals == props and rule.gains(sampled) == []
    chain = VerifyFrame(5, [1, 2], [-1, 0], q=[0.5, 0.5])
    rule = RULES.get(chain.rule_name)
    assert isinstance(rule.request("s", chain, early=False), ChainVerifyRequest)
    with pytest.raises(InvalidRequest, match="chain"):
        rule.request("s", VerifyFrame(5, [1, 2], [-1, -1], q=[0.5, 0.5]), early=False)
