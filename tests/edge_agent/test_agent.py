"""EdgeAgent end to end over LocalTransport (the tree rules' rounds): lossless in every mode and tree shape."""

from __future__ import annotations

import asyncio

import pytest

from specdec.errors import InvalidSamplingParams
from specdec.engine import VerifierEngine
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter, NgramDrafter
from specdec.errors import TokenizerMismatch
from edge_agent.transport import LocalTransport
from tests.edge_agent.helpers import EOS, GREEDY, PROMPT, noisy_copy, run_agent

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




def test_decoded_text_is_released_once_its_utf8_is_complete():
    from edge_agent.agent import DecodedStream

    class Bytes:  # ids are bytes: a two-byte character split over two pushes
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    s = DecodedStream(Bytes())
    assert s.push([ord("a")]) == "a"
    assert s.push([0xC3]) == ""  # half of "é"
    assert s.push([0xA9, ord("b")]) == "éb" and s.text() == "aéb"
