"""One generation's session with the verifier (docs/protocol.md, "One generation, end to end"):
open it, verify frames (a 429 waits ``Retry-After`` and resends the same frame), re-open it from
the edge's history when it is lost, close it; pings measure the RTT on the side.
Notes: docs/edge_agent.md, "edge_agent/link.py"."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from edge_agent.config import AgentConfig
from edge_agent.depth import Telemetry
from edge_agent.errors import ConnectionLost, EdgeError
from edge_agent.stats import GenerationStats
from edge_agent.transport.base import Transport
from specdec import clock
from specdec.errors import KVStateLost, Overloaded, PrefixMismatch, SessionEvicted, SessionNotFound
from specdec.protocol import ClientInfo, OpenSession, ReplyFrame, SessionOpened, VerifyFrame
from specdec.sampling import SamplingParams

# a session to re-open from history (KVStateLost: the replica's KV of it is gone, a pipeline stage's commit failed
# or a tensor-parallel rank died)
LOST = (SessionEvicted, SessionNotFound, ConnectionLost, PrefixMismatch, KVStateLost)


@dataclass
class Client:
    """Who opens the sessions (``ClientInfo`` less the measurements)."""

    agent: str
    draft: str  # the class the replica keeps this agent's acceptance estimates under
    tokenizer_fingerprint: str | None  # None: ids only, the edge cannot vouch for a tokenizer


@dataclass
class SessionLink:
    """The session of one generation: ``prompt_ids`` and ``generated`` (the edge's history, which
    the generation extends as tokens are emitted) are what a re-open sends."""

    transport: Transport
    config: AgentConfig
    telemetry: Telemetry
    client: Client
    params: SamplingParams
    prompt_ids: list[int]
    generated: list[int]
    stats: GenerationStats
    grammar: dict | None = None  # structured output: the GrammarSpec on the wire (the verifier masks by it)
    sid: str = ""
    # whether the session closes itself with its finishing reply (close_on_finish) and that reply came
    closes_itself: dict[str, bool] = field(default_factory=dict)
    ping_task: asyncio.Task | None = None

    # -- open / re-open ---------------------------------------------------------------------
    async def open(self) -> SessionOpened:
        """Open a session from the edge's history (overloaded: retried, jittered, within the
        config's open deadline)."""
        t, cfg = self.telemetry, self.config
        req = OpenSession(prompt_ids=self.prompt_ids, generated_ids=list(self.generated),
                          sampling=self.params.to_dict(), model=cfg.model,
                          client=ClientInfo(tokenizer_fingerprint=self.client.tokenizer_fingerprint,
                                            draft_ms=t.draft_ms.get(0.0), rtt_ms=t.rtt_ms.get(0.0),
                                            agent=self.client.agent, draft=self.client.draft,
                                            # our first round then asks for run-ahead if the hint is 0
                                            run_ahead=cfg.run_ahead and self.stats.verify_rule == "match"),
                          close_on_finish=True, grammar=self.grammar)  # no close round trip before the next open
        t0 = clock.monotonic()
        for attempt in range(cfg.max_overload_waits + 1):
            try:
                sess = await self.transport.open(req)
                if sess.close_on_finish:
                    self.closes_itself[sess.session_id] = sess.finished
                self.sid = sess.session_id
                return sess
            except Overloaded as e:
                wait = e.retry_after * (1 + random.random() / 2)  # jitter: shed agents do not return together
                spent = clock.monotonic() - t0
                if attempt == cfg.max_overload_waits or spent + wait > cfg.open_deadline_s:
                    raise Overloaded(f"the cloud shed this open {attempt + 1} times in {spent:.1f} s ({e.reason}); "
                                     f"gave up within the agent's open deadline of {cfg.open_deadline_s:g} s",
                                     retry_after=e.retry_after, reason=e.reason) from None
                self.stats.overload_waits += 1
                await clock.sleep(wait)
        raise AssertionError("unreachable")

    async def reopen(self, stalled: int) -> SessionOpened:
        """Re-open the lost session from the edge's history; ``stalled`` re-opens in a row
        (without a verified round) back off exponentially: a thrashing KV budget."""
        self.stats.reopens += 1
        await self.close()
        if stalled > 1:
            await clock.sleep(min(0.05 * 2 ** (stalled - 2), 2.0) * (0.5 + random.random()))
        sess = await self.open()
        expected = len(self.prompt_ids) + len(self.generated)
        if sess.prefix_len != expected:
            raise EdgeError(f"re-opened session has prefix {sess.prefix_len}, expected {expected}")
        return sess

    async def reply_or_reopen(self, task: asyncio.Task, stalled: int) -> tuple[ReplyFrame | None,
                                                                                  SessionOpened | None]:
        """(the round's reply, None), or, when the session was lost, (None, the session re-opened
        from the edge's history); ``stalled`` re-opens in a row already: past ``max_reopens`` the
        loss is raised."""
        try:
            return await task, None
        except LOST:
            if stalled + 1 > self.config.max_reopens:
                raise
            return None, await self.reopen(stalled + 1)

    # -- rounds ------------------------------------------------------------------------------
    async def verify(self, frame: VerifyFrame, on_early=None) -> ReplyFrame:
        """One round; ``on_early`` gets the early results (F_EARLY) before the reply."""
        sid = self.sid
        for attempt in range(self.config.max_overload_waits + 1):
            try:
                if on_early is not None:
                    reply = await self.transport.verify(sid, frame, on_early=on_early)
                else:
                    reply = await self.transport.verify(sid, frame)
                if reply.finished and sid in self.closes_itself:
                    self.closes_itself[sid] = True
                return reply
            except Overloaded as e:  # not applied: resend the same frame later
                if attempt == self.config.max_overload_waits:
                    raise
                self.stats.overload_waits += 1
                await clock.sleep(e.retry_after)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """End the session: the server closed it with its finishing reply (``close_on_finish``),
        so only this side's connection goes; else a close request (best effort: the server
        evicts idle sessions)."""
        try:
            if self.closes_itself.pop(self.sid, False):
                await self.transport.release(self.sid)
            else:
                await self.transport.close(self.sid)
        except Exception:  # noqa: BLE001
            pass

    # -- RTT ---------------------------------------------------------------------------------
    async def ping(self) -> None:
        try:
            s = await self.transport.ping()
        except (EdgeError, OSError):
            return
        self.telemetry.observe_rtt(s)
        self.stats.rtt_ms.append(s * 1e3)

    def maybe_ping(self) -> None:
        """Every ``ping_every`` rounds, a ping beside the rounds (one at a time)."""
        every, rounds = self.config.ping_every, self.stats.rounds
        if every and rounds and rounds % every == 0 and self.ping_task is None:
            self.ping_task = asyncio.create_task(self.ping())

    def ping_done(self) -> None:
        if self.ping_task is not None and self.ping_task.done():
            self.ping_task = None

    def stop_pings(self) -> None:
        if self.ping_task is not None:
            self.ping_task.cancel()
