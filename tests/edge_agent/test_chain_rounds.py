"""The rejection rule's rounds (ChainRounds, issue 17) through the agent: chains with q(x), split rejection
sampling; greedy equality, reuse, refills, re-opens, stops, the target's distribution."""

from __future__ import annotations

import asyncio

import pytest

from specdec.engine import VerifierEngine
from specdec.model.loading import tiny_random_model
from specdec.sampling import SamplingParams
from specdec.tree import TreeLimits
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.chain_rounds import ChainRounds
from edge_agent.draft_backends import ModelDrafter, NgramDrafter
from edge_agent.transport import LocalTransport
from tests.edge_agent.helpers import (EOS, GREEDY, PROMPT, marginal, noisy_copy, run_agent, sampled_generations,
                                      sequence_probs)


@pytest.mark.parametrize("mode", ["stop-and-wait", "proactive"])
def test_rejection_rule_greedy_equals_target_only_decoding(engine, draft, greedy_ref, mode):
    res, _ = run_agent(engine, ModelDrafter(draft), GREEDY, rtt_ms=4.0, mode=mode, verify="rejection")
    assert res.token_ids == greedy_ref
    st = res.stats
    assert st.accepted_tokens > 0 and st.rejections == 0 and st.refills == 0  # greedy: the bonus corrects
    assert st.tokens == 1 + st.rounds + st.accepted_tokens
    assert (st.proactive_forwards > 0) == (mode == "proactive")
    res, _ = run_agent(engine, NgramDrafter(), GREEDY, mode=mode, verify="rejection")
    assert res.token_ids == greedy_ref


def test_rejection_rule_proactive_chains_are_reused(engine, draft, greedy_ref):
    res, _ = run_agent(engine, ModelDrafter(draft), GREEDY, rtt_ms=30.0, mode="proactive", verify="rejection",
                       depth_policy="fixed", depth=2)
    assert res.token_ids == greedy_ref
    assert res.stats.aligned > 0 and res.stats.reused_tokens > 0


def test_rejection_rule_zero_budget_hint_is_plain_decoding(engine, draft, greedy_ref):
    transport = LocalTransport(engine, budget_hint=0)
    agent = EdgeAgent(transport, ModelDrafter(draft), config=AgentConfig(verify="rejection"))
    try:
        res = asyncio.run(agent.generate(PROMPT, GREEDY))
    finally:
        agent.close()
    assert res.token_ids == greedy_ref
    assert res.stats.draft_tokens == 0 and res.stats.draft_forwards == 0 and res.stats.proactive_forwards == 0


def test_rejection_rule_sampled_runs_refills_reopens_and_stops(target, monkeypatch):
    """Temperature 1.5 with K = 1 on the server: rejections, residual samples at the edge and
    refills; a seeded run repeats exactly (stop-and-wait, fixed depth: the rounds do not depend
    on timing); sessions lost mid-generation (also while a refill is due) are re-opened without
    loss; stop tokens and max_tokens end it as the server says."""
    eng = VerifierEngine(target, eos_token_ids=EOS, limits=TreeLimits(max_nodes=64, max_depth=16), chain_top_k=1)
    draft = noisy_copy(target, 0.3)
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=50, ignore_eos=True)
    fixed = dict(verify="rejection", mode="stop-and-wait", depth_policy="fixed", depth=3)
    first, _ = run_agent(eng, ModelDrafter(draft), params, **fixed)
    st = first.stats
    assert len(first.token_ids) == 50 and st.rejections > 5 and st.refills > 0 and st.finish_reason == "length"
    again, _ = run_agent(eng, ModelDrafter(draft), params, **fixed)
    assert again.token_ids == first.token_ids
    drops = []

    def drop(transport: LocalTransport, sid: str, rnd: int):
        if rnd in (2, 3, 9, 10, 11, 17):
            transport.drop_session(sid, evicted=rnd % 2 == 0)
            drops.append(sid)

    res, _ = run_agent(eng, ModelDrafter(draft), params, before_verify=drop, verify="rejection")
    assert len(res.token_ids) == 50 and res.stats.reopens == len(drops) == 6

    class LosesSessionOnRefill(LocalTransport):
        """The session is lost just when the edge asks for more candidates: the re-opened one
        answers with a whole new rejection of the same position."""

        lost = 0

        async def verify(self, sid, frame):
            if frame.more and self.lost < 2:
                self.lost += 1
                self.drop_session(sid)
            return await super().verify(sid, frame)

    transport = LosesSessionOnRefill(eng)
    agent = EdgeAgent(transport, ModelDrafter(draft), config=AgentConfig(**fixed))
    try:
        res = asyncio.run(agent.generate(PROMPT, params))
    finally:
        agent.close()
    assert len(res.token_ids) == 50 and transport.lost == 2 and res.stats.reopens == 2
    owed_stops = []
    send_owed = ChainRounds._send_owed

    async def spy(self, *args):  # a resampled stop token: the edge tells the server with an empty chain
        owed_stops.append(await send_owed(self, *args))
        return owed_stops[-1]

    monkeypatch.setattr(ChainRounds, "_send_owed", spy)
    for stop in dict.fromkeys(first.token_ids[2:30]):
        res, _ = run_agent(eng, ModelDrafter(draft), SamplingParams(
            temperature=1.5, seed=3, max_tokens=50, stop_token_ids=(stop,), ignore_eos=True), **fixed)
        assert res.token_ids == first.token_ids[: first.token_ids.index(stop) + 1]
        assert res.stats.finish_reason == "stop"
    assert owed_stops and set(owed_stops) == {"stop"}
    assert not eng.sessions  # every session was closed


@pytest.mark.slow
def test_rejection_rule_through_the_agent_samples_the_target_distribution():
    """The agent end to end (proactive chains, reuse, edge residual samples, refills) over
    LocalTransport on an 8-token vocabulary with K = 2: tokens 2-3 and 4-5 of 5 follow the
    target's marginals."""
    from tests.specdec.test_engine import counts_of
    from tests.specdec.test_sampling import chi_square_pvalue

    v, length, n = 8, 5, 800
    small = tiny_random_model(seed=1, vocab_size=v)
    eng = VerifierEngine(small, eos_token_ids=(), chain_top_k=2)
    prompt, t = [3, 5, 7, 1], SamplingParams(temperature=1.0)

    # a 2 ms RTT: each round's proactive chain (depth + 1 tokens) is drafted whole before the reply,
    # however loaded the machine, so chains are carried over in every run (26 tokens here)
    results = sampled_generations(small, eng, AgentConfig(verify="rejection", depth_policy="fixed", depth=2,
                                                          ping_every=0), prompt, n, length, rtt_ms=2.0)
    assert sum(r.stats.rejections for r in results) > 500 and sum(r.stats.refills for r in results) > 20
    assert sum(r.stats.reused_tokens for r in results) > 10
    joint = sequence_probs(small, prompt, t, length)
    m23, m45 = marginal(joint, 1, 3), marginal(joint, 3, 5)
    c23, c45 = counts_of(tuple(r.token_ids[1:3]) for r in results), counts_of(tuple(r.token_ids[3:]) for r in results)
    # proactive drafting makes the rounds timing-dependent (not seed-repeatable): a lower bar
    assert chi_square_pvalue(c23, m23) > 1e-4 and chi_square_pvalue(c45, m45) > 1e-4


