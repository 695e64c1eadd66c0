"""The edge's side of each verify rule (issue 62; :mod:`specdec.rules`): the round strategy that
runs a generation's rounds, and the rule to use instead where a request's sampling makes this
one pointless or unsupported.
Notes: docs/edge_agent.md, "edge_agent/rules.py"."""

from __future__ import annotations

from specdec.protocol import SessionOpened
from specdec.rules import RuleRegistry
from specdec.sampling import SamplingParams
from edge_agent.chain_rounds import ChainRounds
from edge_agent.config import REGISTERED_RULES
from edge_agent.link import SessionLink
from edge_agent.rounds import Edge, Generation, Rounds
from edge_agent.tree_rounds import TreeRounds


class EdgeRule:
    """A rule's round strategy on the edge; the base drafts trees (:class:`TreeRounds`)."""

    name = "match"

    def rounds(self, edge: Edge, link: SessionLink, gen: Generation, sess: SessionOpened) -> Rounds:
        return TreeRounds(edge, link, gen, sess, self.name)

    def instead(self, params: SamplingParams) -> str | None:
        """The rule to run for ``params`` instead of this one, if any."""
        return None


class TreeRejectionRule(EdgeRule):
    name = "tree-rejection"

    def instead(self, params: SamplingParams) -> str | None:
        # a point-mass target accepts the argmax's child whatever the rule: SpecExec trees
        return "match" if params.greedy else None


class ChainRejectionRule(EdgeRule):
    name = "rejection"

    def rounds(self, edge: Edge, link: SessionLink, gen: Generation, sess: SessionOpened) -> Rounds:
        return ChainRounds(edge, link, gen, sess)

    def instead(self, params: SamplingParams) -> str | None:
        # a chain's rejected token is the edge's sample: the server has log-probs for trees only
        return "match" if params.logprobs is not None else None


RULES: RuleRegistry[EdgeRule] = RuleRegistry("edge")


def register(rule: EdgeRule) -> EdgeRule:
    """Register ``rule`` under its name; ``AgentConfig.verify`` accepts the name from then on."""
    RULES.register(rule.name, rule)
    REGISTERED_RULES.add(rule.name)
    return rule


for _rule in (EdgeRule(), TreeRejectionRule(), ChainRejectionRule()):
    register(_rule)
