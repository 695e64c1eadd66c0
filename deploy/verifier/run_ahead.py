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

The replica's runs (:class:`AheadRuns`): while the best budget is 0 each verified round queues
one more step (an empty tree) in the next forward; any request but the one that takes a detached
run over meets ``409 prefix_mismatch``; an open whose edge promised an ``F_AHEAD`` first request
(``client.run_ahead``) starts detached from its first token; a failed step answers its request
with the tokens decoded so far, so none is lost. No Ray.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from deploy.verifier.counters import Takeovers
from deploy.verifier.queued_round import QueuedRound
from deploy.verifier.scheduler import Pending
from deploy.verifier.sessions import EdgeClient
from specdec.engine import OpenResult, VerifyRequest, VerifyResult
from specdec.errors import PrefixMismatch
from specdec.protocol import ReplyFrame, VerifyFrame
from specdec.tree import DraftTree


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
        verified = self.verified if self.verified < self.tree_nodes else None
        return ReplyFrame.of_run(self.accepted, self.tokens, self.last, verified, depth_hint, budget_hint)


class AheadRuns:
    """Detached runs by session, and the steps of every run. Its methods return the step
    (:class:`Pending`) to queue next, if any; the replica queues it and does a reply's bookkeeping."""

    def __init__(self, limit: int, takeovers: Takeovers):
        self.limit = limit  # verifier.run_ahead_tokens (0: off)
        self.takeovers = takeovers
        self.detached: dict[str, RunAhead] = {}  # sid -> its run between a reply and the next request

    def tokens(self, asks: bool) -> int:
        """Tokens a no-tree request brings back: with run-ahead (asked for, and on), the limit and
        the bonus; else the bonus alone."""
        return self.limit + 1 if asks and self.limit else 1

    def take_over(self, sid: str, f: VerifyFrame, fut: asyncio.Future) -> RunAhead:
        """The edge's next request takes its session's detached run over: the run now answers
        ``fut`` (its reply is ready unless ``run.queued``). Raises ``PrefixMismatch`` if the
        request does not continue the run."""
        run = self.detached[sid]
        if not f.ahead or f.prefix_len != run.base_prefix:
            raise PrefixMismatch(
                f"request assumes a prefix of {f.prefix_len} tokens; this session ran ahead from "
                f"{run.base_prefix} (F_AHEAD): send F_AHEAD at that prefix, or re-open it",
                server_prefix_len=run.base_prefix)
        del self.detached[sid]
        t = self.takeovers
        if run.queued:
            t.running += 1
        elif run.full:
            t.full += 1
        else:
            t.stopped += 1
        run.attach(fut, len(f.tokens))
        return run

    def from_open(self, tenant: str, res: OpenResult, edge: EdgeClient | None, budget: int,
                  now: float) -> Pending | None:
        """An open whose edge promised an ``F_AHEAD`` first request and whose budget hint is 0
        decodes on from its first token, detached: its first step."""
        # edge.ahead is 1 with run-ahead off (verifier.run_ahead_tokens 0)
        if budget or res.finished or res.first_token is None or edge is None or not edge.run_from_open \
                or edge.ahead <= 1:
            return None
        run = self.detached[res.sid] = RunAhead(edge.ahead - 1, res.prefix_len)  # as a request's run
        return self.step(tenant, res.sid, run, now)

    @staticmethod
    def step(tenant: str, sid: str, run: RunAhead, now: float) -> Pending:
        """One more run-ahead step: an empty tree at the run's prefix, for the next forward."""
        run.queued = True
        req = VerifyRequest(sid, DraftTree.empty(), run.next_prefix)
        return Pending(tenant, sid, 1, QueuedRound(req, None, [], run), now)

    def advance(self, p: Pending, res: VerifyResult, best_budget: int, now: float) -> Pending | None:
        """A run's round verified: its next step, if it decodes on. Its request is answered
        now unless a step follows or the run is detached (its tokens wait for the next request)."""
        run = p.payload.run
        run.add(res)
        run.queued = False
        # decoding on needs the best budget to be 0 (a step's hints are 0); only a reply asks the
        # pacer for its hint, so exploration stays one in explore_every replies
        return self.step(p.tenant, p.session_id, run, now) if run.continues(best_budget) else None

    def so_far(self, p: Pending) -> RunAhead | None:
        """A run-ahead step that failed (its session evicted or closed meanwhile, a failed
        forward): the run whose request is owed a reply with the tokens decoded so far, so none
        is lost; the edge's next request meets the failure. None for any other round, or with
        nothing to send."""
        run = p.payload.run
        if run is None:
            return None
        run.queued = False
        if self.detached.get(p.session_id) is run:
            del self.detached[p.session_id]
        return None if run.fut is None or run.last is None else run

    def replied(self, tenant: str, sid: str, run: RunAhead, budget: int, now: float) -> Pending | None:
        """A run-ahead request is answered: while the budget hint stays 0 the session decodes on,
        detached, until the edge's next request takes the run over; that run's first step."""
        if budget == 0 and not run.ended and not run.fut.done():
            nxt = self.detached[sid] = RunAhead(run.limit, run.last.prefix_len)
            return self.step(tenant, sid, nxt, now)
        return None
