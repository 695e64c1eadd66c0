"""The session link through the agent: a lost session is re-opened from the edge's history without loss; a
shed open is retried with jitter, then given up within the deadline."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec.errors import Overloaded
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.drafter import ModelDrafter
from edge_agent.transport import LocalTransport
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
