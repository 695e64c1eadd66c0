"""The verifier's side of each verify rule (issue 62; :mod:`specdec.rules`): request, truncation gains, reply.

Built in: ``match`` (SpecEdge §4.3), ``tree-rejection``, ``rejection`` (DSSD); ``verifier.rule_modules`` add more."""

from __future__ import annotations

from specdec.engine import ChainVerifyRequest, VerifyRequest
from specdec.errors import InvalidRequest
from specdec.protocol import ReplyFrame, VerifyFrame
from specdec.rules import RuleRegistry
from specdec.tree import DraftTree
from specdec.truncation import node_gains


class VerifierRule:
    """A rule's handling on the verifier; the base verifies by the target's own walk and replies with it."""

    name = "match"
    early = False  # takes F_EARLY (the round's early results from the exit heads)

    def request(self, sid: str, f: VerifyFrame, early: bool) -> VerifyRequest | ChainVerifyRequest:
        return VerifyRequest(sid, DraftTree(tuple(f.tokens), tuple(f.parents)), f.prefix_len, early=early)

    def gains(self, f: VerifyFrame) -> list[float]:
        """Per-node draft gains for batch-time truncation; [] when the tree must not be cut."""
        return []

    def refill(self, req) -> bool:
        """Whether the round verified no draft (nothing for the pacer to learn from)."""
        return False

    def reply(self, req, res, depth: int, budget: int) -> ReplyFrame:
        return ReplyFrame.of_tree(res, depth, budget, len(req.tree))


class MatchRule(VerifierRule):
    name, early = "match", True

    def gains(self, f: VerifyFrame) -> list[float]:
        return node_gains(f.parents, f.conf)


class TreeRejectionRule(VerifierRule):
    """Sampled trees with their proposals: never cut by value (a value-dependent cut would bias them)."""

    name = "tree-rejection"

    def request(self, sid: str, f: VerifyFrame, early: bool) -> VerifyRequest:
        return VerifyRequest(sid, DraftTree(tuple(f.tokens), tuple(f.parents)), f.prefix_len, proposals=f.proposals)


class ChainRejectionRule(VerifierRule):
    name = "rejection"

    def request(self, sid: str, f: VerifyFrame, early: bool) -> ChainVerifyRequest:
        if any(p != i - 1 for i, p in enumerate(f.parents)):
            raise InvalidRequest("chain mode: parents must form a chain")
        return ChainVerifyRequest(sid, tuple(f.tokens), tuple(f.q), f.prefix_len, f.resampled, f.more)

    def refill(self, req) -> bool:
        return req.more  # more residual candidates: no draft was verified

    def reply(self, req, res, depth: int, budget: int) -> ReplyFrame:
        return ReplyFrame.of_chain(res, depth, budget)


RULES: RuleRegistry[VerifierRule] = RuleRegistry("verifier")
for _rule in (MatchRule(), TreeRejectionRule(), ChainRejectionRule()):
    RULES.register(_rule.name, _rule)
