"""A toy verify rule's verifier side (issue 62): the frame's tree, its payload its node count as
a u16 (checked), verified by the target's own walk. Registered on import (``verifier.rule_modules``)."""

from __future__ import annotations

import struct

from deploy.verifier.rules import RULES, VerifierRule
from specdec.errors import InvalidRequest


class ToyRule(VerifierRule):
    name = "toy-count"

    def request(self, sid, f, early):
        if f.payload != struct.pack("<H", len(f.tokens)):
            raise InvalidRequest("toy-count: the payload is not the node count")
        return super().request(sid, f, early)


RULES.register(ToyRule.name, ToyRule())
