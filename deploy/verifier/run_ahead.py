"""Run-ahead: decoding a session on past its bonus while trees do not pay.

A request that opts in (``F_AHEAD``, :mod:`specdec.protocol`) lets the replica keep its session
in the following forwards, one empty-tree round each, and answer once with the first round's
accepted nodes and bonus, then at most ``verifier.run_ahead_tokens`` tokens past it. A run stops
when the best budget turns non-zero, the session finishes, or its client goes. Between a reply
and the edge's next request the run continues *detached*; that request (``F_AHEAD``, at the
prefix the edge holds) takes it over, and the tree it carries is not verified (0 nodes verified).

Lossless: every step is a verified empty-tree round, so the edge receives exactly what
round-by-round decoding gives (greedy: the target's tokens; sampled: the same draws from p, in
order). Why: docs/engine.md, "Run-ahead when trees do not pay".

Pure module: no Ray, no asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.engine import VerifyResult
from specdec.protocol import ReplyFrame


@dataclass
class RunAhead:
    """One session's run: the tokens decoded past the prefix its edge holds, and the request
    they answer (``fut``; None while detached, until the edge's next request takes it over)."""

    limit: int  # most tokens past the bonus in one reply (verifier.run_ahead_tokens)
    base_prefix: int  # the prefix the edge holds: this run's tokens follow it
    fut: Any = None  # the request it answers; None: detached
    tree_nodes: int = 0  # nodes of that request's tree (the reply says how many were verified)
    accepted: list[int] = field(default_factory=list)  # the request's accepted node indices (its own round)
    verified: int = 0  # nodes of the request's tree verified (0 when the run was detached: not verified)
    tokens: list[int] = field(default_factory=list)  # past the accepted nodes: the bonus, then one per step
    last: VerifyResult | None = None  # the latest step's result
    queued: bool = False  # a step of this run waits in the replica's scheduler

    def add(self, res: VerifyResult) -> None:
        """A round of this run: the request's own (its tree) or a step (an empty tree)."""
        if self.last is None:
            self.accepted, self.verified = list(res.accepted), res.verified
        self.tokens.extend(res.tokens[len(res.accepted):])
        self.last = res

    def attach(self, fut: Any, tree_nodes: int) -> None:
        """The edge's next request takes a detached run over (its tree is not verified)."""
        self.fut, self.tree_nodes = fut, tree_nodes

    @property
    def next_prefix(self) -> int:
        """The prefix the run's next step extends."""
        return self.last.prefix_len if self.last is not None else self.base_prefix

    @property
    def full(self) -> bool:
        return len(self.tokens) > self.limit  # the bonus and ``limit`` tokens past it

    @property
    def ended(self) -> bool:
        """The session can decode no further (finished, or its last round had no bonus)."""
        res = self.last
        return res is not None and (res.finished or res.bonus is None)

    def continues(self, best_budget: int) -> bool:
        """Whether to decode one more step before replying (or, detached, before the request)."""
        gone = self.fut is not None and self.fut.done()
        return not self.ended and best_budget == 0 and not gone and not self.full

    def frame(self, depth_hint: int, budget_hint: int) -> ReplyFrame:
        """The reply: the request's accepted nodes, the bonus, the tokens past it; the prefix
        and finish state after the last step."""
        last = self.last
        return ReplyFrame(list(self.accepted), self.tokens[0] if self.tokens else None, last.prefix_len,
                          last.finished, last.finish_reason, depth_hint, budget_hint,
                          verified=self.verified if self.verified < self.tree_nodes else None,
                          ahead=list(self.tokens[1:]))
