"""EdgeAgent end to end over LocalTransport: lossless in every mode, re-open after loss."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec.errors import InvalidSamplingParams, Overloaded
from specdec.engine import VerifierEngine
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from specdec.tree import TreeLimits
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.chain_rounds import ChainRounds
from edge_agent.drafter import ModelDrafter, NgramDrafter
from edge_agent.errors import TokenizerMismatch
from edge_agent.transport import LocalTransport
from tests.edge_agent.helpers import marginal, noisy_copy, sampled_generations, sequence_probs

EOS = [2]
PROMPT = [1, 5, 9, 33, 7, 100, 200, 33, 7]


@pytest.fixture(scope="module")
def engine(target):
    return VerifierEngine(target, eos_token_ids=EOS, limits=TreeLimits(max_nodes=64, max_depth=16))


def run_agent(engine, drafter, params, prompt=PROMPT, rtt_ms=0.0, before_verify=None, **cfg):
    transport = LocalTransport(engine, rtt_ms=rtt_ms, before_verify=before_verify)
    agent = EdgeAgent(transport, drafter, config=AgentConfig(**cfg))
    try:
        return asyncio.run(agent.generate(prompt, params)), transport
    finally:
        agent.close()


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_ref(target):
    return reference_decode(target, PROMPT, GREEDY, EOS)


@pytest.mark.parametrize("mode", ["stop-and-wait", "proactive"])
@pytest.mark.parametrize("policy", ["fixed", "server", "flexspec", "auto"])
def test_greedy_equals_target_only_decoding_in_every_mode(engine, draft, greedy_ref, mode, policy):
    res, _ = run_agent(engine, ModelDrafter(draft), GREEDY, rtt_ms=4.0, mode=mode, depth_policy=policy)
    assert res.token_ids == greedy_ref
    st = res.stats
    assert st.tokens == len(greedy_ref) and st.rounds > 0
    assert st.accepted_tokens > 0  # the noisy draft agrees often enough to be accepted
    assert st.tokens == 1 + st.rounds + st.accepted_tokens  # first token + (accepted + bonus) per round
    if mode == "stop-and-wait":
        assert st.align_attempts == 0 and st.proactive_forwards == 0 and st.predraft_forwards == 0
    else:  # drafted ahead (its own guesses, then the chain) and checked that work against each reply
        assert st.proactive_forwards + st.predraft_forwards > 0
        assert st.align_attempts + st.predraft_hits + st.predraft_misses >= st.rounds - 1


@pytest.mark.parametrize("cfg", [dict(topk=1, max_expand=1, depth=5, depth_policy="fixed"),  # chain
                                 dict(budget=8, topk=2, depth=2, depth_policy="fixed"),
                                 dict(budget=64, topk=8, max_expand=16, depth=8, depth_policy="fixed")])
def test_greedy_equality_for_chains_and_tree_shapes(engine, draft, greedy_ref, cfg):
    res, _ = run_agent(engine, ModelDrafter(draft), GREEDY, mode="proactive", **cfg)
    assert res.token_ids == greedy_ref


@pytest.mark.parametrize("mode", ["stop-and-wait", "proactive"])
def test_a_zero_budget_hint_is_plain_decoding_through_the_edge_path(engine, draft, greedy_ref, mode):
    """Issue 15: the server may say "no tree" (budget 0); the edge then sends empty trees and
    runs no draft forward at all, and the output is server AR's, token for token."""
    transport = LocalTransport(engine, budget_hint=0)
    agent = EdgeAgent(transport, ModelDrafter(draft), config=AgentConfig(mode=mode))
    try:
        res = asyncio.run(agent.generate(PROMPT, GREEDY))
    finally:
        agent.close()
    assert res.token_ids == greedy_ref
    st = res.stats
    assert st.draft_tokens == 0 and st.draft_forwards == 0 and st.proactive_forwards == 0
    assert st.rounds == len(greedy_ref) - 1  # one token per round after the first


def test_truncated_draft_and_ngram_drafter_are_lossless(engine, target, greedy_ref):
    short = noisy_copy(target, 0.0, num_layers=1)
    res, _ = run_agent(engine, ModelDrafter(short), GREEDY, mode="proactive")
    assert res.token_ids == greedy_ref
    res, _ = run_agent(engine, NgramDrafter(), GREEDY, mode="proactive")
    assert res.token_ids == greedy_ref


def test_proactive_alignment_happens_and_reuse_is_counted(engine, draft, greedy_ref):
    """``guesses=0``: SpecEdge §4.2 as published, one proactive chain below the best leaf."""
    # a 30 ms simulated RTT leaves time for several proactive forwards per round
    res, _ = run_agent(engine, ModelDrafter(draft), GREEDY, rtt_ms=30.0, mode="proactive",
                       depth_policy="fixed", depth=2, budget=6, topk=2, guesses=0)
    assert res.token_ids == greedy_ref
    st = res.stats
    assert st.aligned > 0 and st.reused_tokens > 0
    assert 0 < st.alignment_rate <= 1
    assert st.mean_rtt_ms >= 25
    assert st.predraft_forwards == st.predraft_hits == st.predraft_misses == st.predraft_guessed == 0


def test_own_guesses_hit_and_their_trees_go_out_at_once(engine, draft, greedy_ref):
    """The edge's own guesses (edge_agent/predraft.py): with time for them, most replies match
    a guess, whose next tree is sent without a draft forward; the output is the target's. (80 ms
    of RTT for the 6 guesses' 12 forwards: at 30 ms, on a loaded 2-core machine, a hit's tree
    was once still unfinished when its reply came.)"""
    res, _ = run_agent(engine, ModelDrafter(draft), GREEDY, rtt_ms=80.0, mode="proactive",
                       depth_policy="fixed", depth=2, budget=6, topk=2, guesses=6)
    assert res.token_ids == greedy_ref
    st = res.stats
    assert st.predraft_guessed > 0 and st.predraft_hits + st.predraft_misses >= st.rounds - 1
    assert st.predraft_hits >= st.rounds // 2
    # a hit's tree is complete: the rounds after hits ran no draft forward before sending
    assert st.draft_forwards <= 2 * (st.rounds - st.predraft_hits) + 2


def test_seeded_sampling_follows_the_target_only_sample_path(engine, target, draft):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=30, ignore_eos=True)
    ref = reference_decode(target, PROMPT, params, EOS)
    for mode, guesses in (("stop-and-wait", 0), ("proactive", 0), ("proactive", 6)):
        res, _ = run_agent(engine, ModelDrafter(draft), params, mode=mode, guesses=guesses, rtt_ms=10.0 * guesses)
        assert res.token_ids == ref


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


def test_stop_tokens_max_tokens_and_first_token_finish(engine, target, draft, greedy_ref):
    stop = greedy_ref[7]
    params = SamplingParams(max_tokens=40, stop_token_ids=(stop,), ignore_eos=True)
    res, _ = run_agent(engine, ModelDrafter(draft), params)
    assert res.token_ids == greedy_ref[: greedy_ref.index(stop) + 1]
    assert res.stats.finish_reason == "stop"
    for n in (1, 2, 3):
        res, _ = run_agent(engine, ModelDrafter(draft), SamplingParams(max_tokens=n, ignore_eos=True))
        assert res.token_ids == greedy_ref[:n] and res.stats.finish_reason == "length"
    assert not engine.sessions  # every session was closed


def test_bad_params_and_vocab_mismatch_are_clear_errors(engine, target):
    with pytest.raises(InvalidSamplingParams):
        run_agent(engine, NgramDrafter(), SamplingParams(top_p=0.0))
    wrong = tiny_random_model(seed=3, vocab_size=300)
    with pytest.raises(TokenizerMismatch, match="vocabulary"):
        run_agent(engine, ModelDrafter(wrong), GREEDY)


@pytest.mark.slow
def test_embedded_model_greedy_through_the_agent(embedded):
    """The real SmolLM2 target (fp32) with a 4-layer copy as the draft, chat prompt."""
    from edge_agent.agent import encode_prompt

    tok = embedded.tokenizer
    prompt = encode_prompt(tok, "Name three primary colors.", chat=True)
    params = SamplingParams(max_tokens=24)
    ref = reference_decode(embedded.model, prompt, params, embedded.eos_token_ids)
    eng = VerifierEngine(embedded.model, eos_token_ids=embedded.eos_token_ids)
    from specdec.model.loading import tokenizer_fingerprint

    for drafter, mode in ((NgramDrafter(), "stop-and-wait"),
                          (ModelDrafter(noisy_copy(embedded.model, 0.0, num_layers=4)), "proactive")):
        transport = LocalTransport(eng, model_name="embedded", tokenizer_fingerprint=tokenizer_fingerprint(tok))
        agent = EdgeAgent(transport, drafter, tokenizer=tok, config=AgentConfig(mode=mode, budget=16))
        pieces = []
        res = asyncio.run(agent.generate(prompt, params, on_text=pieces.append))
        agent.close()
        assert res.token_ids == ref
        assert "".join(pieces) == res.text == tok.decode(ref, skip_special_tokens=True)


# -- the rejection rule (issue 17): chains with q(x), split rejection sampling ---------------
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


def test_the_summary_line_names_early_frames_and_rejections_only_when_there_were_some():
    from edge_agent.agent import GenerationStats

    plain = GenerationStats(tokens=10, rounds=4, accepted_tokens=6).summary()
    assert "early frames" not in plain and "rejections" not in plain
    pre = GenerationStats(tokens=10, rounds=4, early_frames=4, predraft_hits=1, predraft_misses=3, rejections=2)
    assert "4 early frames, pre-draft hits 1/4, 2 rejections" in pre.summary()


def test_agents_sharing_one_draft_executor_stay_lossless_and_leave_it_open(engine, draft, greedy_ref):
    """Several sessions on one device (an edge gateway, the benchmark's edge core) share one
    DraftExecutor: each output is still the target's own, and closing an agent does not stop the
    executor the others use."""
    from edge_agent.draft_executor import CRITICAL, DraftExecutor

    shared = DraftExecutor()

    async def main():
        agents = [EdgeAgent(LocalTransport(engine, rtt_ms=5.0), ModelDrafter(draft),
                            config=AgentConfig(mode="proactive"), draft_executor=shared) for _ in range(3)]
        try:
            return await asyncio.gather(*(a.generate(PROMPT, GREEDY) for a in agents))
        finally:
            for a in agents:
                a.close()

    try:
        results = asyncio.run(main())
        assert [r.token_ids for r in results] == [greedy_ref] * 3
        assert sum(r.stats.proactive_forwards + r.stats.predraft_forwards for r in results) > 0
        assert shared.submit(CRITICAL, lambda: "open").result(timeout=5) == "open"
    finally:
        shared.shutdown()


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
