"""A toy verify rule's edge side (issue 62): tree rounds whose frames travel as the registered rule
``toy-count`` (its payload: the node count as a u16). Registered on import."""

from __future__ import annotations

import struct

from edge_agent.rules import EdgeRule, register
from edge_agent.tree_rounds import TreeRounds
from specdec.protocol import VerifyFrame


class ToyRounds(TreeRounds):
    async def _draft_tree(self, proactive):
        tree, f = await super()._draft_tree(proactive)
        return tree, VerifyFrame(f.prefix_len, f.tokens, f.parents, f.draft_ms, f.rtt_ms, f.depth, rule=ToyRule.name,
                                 payload=struct.pack("<H", len(f.tokens)))


class ToyRule(EdgeRule):
    name = "toy-count"

    def rounds(self, edge, link, gen, sess):
        return ToyRounds(edge, link, gen, sess, self.name)


register(ToyRule())
