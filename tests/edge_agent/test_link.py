"""The session link: through the agent, a lost session is re-opened from the edge's history without loss and
a shed open is retried with jitter, then given up within the deadline; alone, a 429 on verify resends the
same frame, and a session that closed itself is only released."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec.errors import Overloaded
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.transport import LocalTransport, Transport
from tests.edge_agent.helpers import EOS, GREEDY, PROMPT, run_agent


@pytest.mark.parametrize("evicted", [True, False])
def test_session_dropped_mid_generation_is_reopened_without_loss(engine, draft, greedy_ref, evicted):
    dropped = []

    def drop(transport: LocalTransport, sid: str, rnd: int):
        if rnd in (2, 5, 6):  # between rounds, three times (twice in a row)
            transport.drop_session(sid, evicted=evicted)
            dropped.append(sid)

    for mode in ("stop-and-wait", "proactive"):
        dropped.clear()
        res, tr = run_agent(engine, ModelDrafter(draft), GREEDY, before_verify=drop, mode=mode)
        assert res.token_ids == greedy_ref
        assert res.stats.reopens == 3 and len(set(dropped)) == 3
        assert not (set(engine.sessions) & set(dropped))


def test_seeded_sampling_survives_reopen(engine, target, draft):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    ref = reference_decode(target, PROMPT, params, EOS)
    res, _ = run_agent(engine, ModelDrafter(draft), params,
                       before_verify=lambda t, sid, r: t.drop_session(sid) if r == 3 else None)
    assert res.token_ids == ref and res.stats.reopens == 1



class ShedsOpens(LocalTransport):
    """Answers the first ``sheds`` opens 429 (as the router's open deadline does)."""

    def __init__(self, engine, sheds: int):
        super().__init__(engine)
        self.sheds, self.opens = sheds, 0

    async def open(self, req):
        self.opens += 1
        if self.opens <= self.sheds:
            raise Overloaded("shed", retry_after=0.05, reason="open_deadline")
        return await super().open(req)


def test_a_shed_open_is_retried_with_jitter_then_given_up_within_the_deadline(engine, draft):
    transport = ShedsOpens(engine, sheds=2)
    agent = EdgeAgent(transport, ModelDrafter(draft), config=AgentConfig(open_deadline_s=5.0))
    try:
        res = asyncio.run(agent.generate(PROMPT, GREEDY))
    finally:
        agent.close()
    assert len(res.token_ids) == 40 and res.stats.overload_waits == 2 and transport.opens == 3

    transport = ShedsOpens(engine, sheds=10**6)
    agent = EdgeAgent(transport, ModelDrafter(draft), config=AgentConfig(open_deadline_s=0.3))
    t0 = time.monotonic()
    try:
        with pytest.raises(Overloaded, match="gave up within the agent's open deadline of 0.3 s") as e:
            asyncio.run(agent.generate(PROMPT, GREEDY))
    finally:
        agent.close()
    assert time.monotonic() - t0 < 0.6 and 2 <= transport.opens <= 8 and e.value.reason == "open_deadline"


class Busy(Transport):
    """A fake server: opens at once, answers the first ``busy`` verifies 429, records what it was sent."""

    def __init__(self, busy: int):
        self.busy, self.frames, self.released, self.closed = busy, [], [], []

    async def open(self, req):
        from specdec.protocol import SessionOpened

        return SessionOpened(session_id="s", prefix_len=len(req.prompt_ids), first_token=3, finished=False,
                             depth_hint=2, budget_hint=8, tokenizer_fingerprint="x", model="m", close_on_finish=True)

    async def verify(self, sid, frame):
        from specdec.protocol import ReplyFrame

        self.frames.append(frame)
        if len(self.frames) <= self.busy:
            raise Overloaded("busy", retry_after=0.001)
        return ReplyFrame([], 5, frame.prefix_len + 1, finished=True)

    async def release(self, sid):
        self.released.append(sid)

    async def close(self, sid):
        self.closed.append(sid)


def _link(transport, **cfg):
    from edge_agent.depth import Telemetry
    from edge_agent.link import Client, SessionLink
    from edge_agent.stats import GenerationStats

    return SessionLink(transport, AgentConfig(**cfg), Telemetry(), Client("a", "d", None), SamplingParams(),
                       [1, 2], [], GenerationStats())


def test_a_429_on_verify_resends_the_same_frame_and_a_finished_session_is_only_released():
    from specdec.protocol import VerifyFrame

    transport = Busy(busy=2)
    link = _link(transport, max_overload_waits=2)

    async def main():
        await link.open()
        reply = await link.verify(VerifyFrame(prefix_len=3, tokens=[], parents=[]))
        await link.close()
        return reply

    reply = asyncio.run(main())
    assert reply.finished and len(transport.frames) == 3 and link.stats.overload_waits == 2
    assert transport.frames[0] is transport.frames[1] is transport.frames[2]
    assert transport.released == ["s"] and transport.closed == []  # it closed itself with its finishing reply

    transport = Busy(busy=10)
    link = _link(transport, max_overload_waits=1)

    async def gives_up():
        await link.open()
        with pytest.raises(Overloaded):
            await link.verify(VerifyFrame(prefix_len=3, tokens=[], parents=[]))
        await link.close()

    asyncio.run(gives_up())
    assert len(transport.frames) == 2 and transport.closed == ["s"]
