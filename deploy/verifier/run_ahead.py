"""Run-ahead: decoding a session on past its bonus while trees do not pay.

On a CPU the verify forward turns compute-bound at a few rows, so from a few sessions up the
tree budget is 0 (:mod:`deploy.verifier.pacing`) and an edge decodes plainly: one token per
round trip. A session is then absent from every forward that runs while its reply and next
request are on the wire, and each token costs a whole request through the proxy, the router
and the replica. Measured before this module (`benchmarks.run --full`, 16 sessions, RTT
15 ms, one server core): 13.6 sessions per forward instead of 16, and 5.50 ms of server CPU
per token against 4.53 for server-side decoding (`server_ar`).

A request that opts in (``F_AHEAD``, :mod:`deploy.protocol`) lets the replica keep the
session in the following forwards, one token each, as the server-side loop would, and answer
once with all of them: the first round's accepted nodes and bonus, then the tokens past it.
It stops at ``verifier.run_ahead_tokens`` tokens, as soon as the budget turns non-zero (the
edge's tree pays again; the reply brings the hint), when the session finishes, or when its
client is gone. Each continuation step is a round with an empty tree, verified like any other,
so what the edge receives is exactly what it would have decoded round by round.

Pure module: no Ray, no asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deploy.protocol import ReplyFrame
from deploy.verifier.engine import VerifyResult


@dataclass
class RunAhead:
    """One opted-in request: its first round's result and the tokens decoded after it."""

    limit: int  # most tokens past the first round's bonus (verifier.run_ahead_tokens)
    tree_nodes: int  # nodes the request sent (its reply says how many were verified when cut)
    first: VerifyResult | None = None
    last: VerifyResult | None = None
    tokens: list[int] = field(default_factory=list)  # past the first bonus, one per step

    @property
    def started(self) -> bool:
        return self.first is not None

    def add(self, res: VerifyResult) -> None:
        """A round of this request: the first (its tree) or a continuation step (an empty tree)."""
        if self.first is None:
            self.first = res
        else:
            self.tokens.extend(res.tokens)
        self.last = res

    def continues(self, budget_hint: int, client_gone: bool) -> bool:
        """Whether to decode one more token before replying."""
        res = self.last
        return (res is not None and not res.finished and res.bonus is not None and budget_hint == 0
                and not client_gone and len(self.tokens) < self.limit)

    def frame(self, depth_hint: int, budget_hint: int) -> ReplyFrame:
        """The reply: the first round's outcome, the prefix and finish state after the last step."""
        first, last = self.first, self.last
        return ReplyFrame(list(first.accepted), first.bonus, last.prefix_len, last.finished, last.finish_reason,
                          depth_hint, budget_hint,
                          verified=first.verified if first.verified < self.tree_nodes else None,
                          ahead=list(self.tokens))
