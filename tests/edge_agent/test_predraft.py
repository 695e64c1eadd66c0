"""The pre-draft cache (edge_agent/predraft.py) end to end over LocalTransport with exit heads.

An *oracle* exit: the target's last layer is made an identity (its output projections are
zero), so the logit lens after the layer before it equals the final layer and every early
result is right: rounds hit and send pre-drafted trees. A *wrong* exit predicts a token the
target never emits: every round misses. Either way the output is the target's, token for
token (greedy and the seeded sample path).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from specdec.engine import VerifierEngine
from specdec.exit_heads import ExitHeads
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from specdec.tree import TreeLimits
from edge_agent.transport import local as transport_module
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.transport import LocalTransport
from tests.edge_agent.helpers import noisy_copy

EOS = [2]
PROMPT = [1, 5, 9, 33, 7, 100, 200, 33, 7]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
REST_OF_FORWARD_S = 0.03  # the forward's time after the exit layer (a large target's later layers)


@pytest.fixture(scope="module")
def target():
    m = tiny_random_model(seed=4, num_layers=3)
    last = m.model.layers[-1]
    with torch.no_grad():  # the last layer adds nothing: the exit after layer 2 is the final layer
        last.self_attn.o_proj.weight.zero_()
        last.mlp.down_proj.weight.zero_()
    return m


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, 0.02)


@pytest.fixture(autouse=True)
def slow_tail(monkeypatch):
    """The early results leave the forward REST_OF_FORWARD_S before its end (a big target's
    later layers), so the edge has time to pre-draft before the reply."""
    real = transport_module._early_sink

    def sink(loop, on_early, delay_s):
        inner = real(loop, on_early, delay_s)

        def slow(results):
            inner(results)
            time.sleep(REST_OF_FORWARD_S)
        return slow

    monkeypatch.setattr(transport_module, "_early_sink", sink)


def run(target, draft, params, ids=None, **cfg):
    eng = VerifierEngine(target, eos_token_ids=EOS, limits=TreeLimits(max_nodes=64, max_depth=16))
    eng.exit_heads = ExitHeads.init(target, (2,), rank=4, ids=ids)
    agent = EdgeAgent(LocalTransport(eng, rtt_ms=10.0), ModelDrafter(draft),
                      config=AgentConfig(predraft=True, depth_policy="fixed", depth=3, **cfg))
    try:
        return asyncio.run(agent.generate(PROMPT, params))
    finally:
        agent.close()


@pytest.mark.parametrize("mode", ["proactive", "stop-and-wait"])
def test_oracle_exits_hit_and_the_output_is_the_targets(target, draft, mode):
    res = run(target, draft, GREEDY, mode=mode)
    assert res.token_ids == reference_decode(target, PROMPT, GREEDY, EOS)
    s = res.stats
    assert s.early_frames >= s.rounds - 1 > 0  # the last round (one token left) sends no tree
    assert s.predraft_hits >= s.rounds // 2 and s.predraft_forwards > 0
    assert s.predraft_layer_sum == 2 * s.predraft_hits


def test_a_wrong_exit_misses_every_round_and_the_output_is_the_targets(target, draft):
    ref = reference_decode(target, PROMPT, GREEDY, EOS)
    bad = next(t for t in range(3, target.config.vocab_size) if t not in ref)
    res = run(target, draft, GREEDY, ids=torch.tensor([bad]), mode="proactive")
    assert res.token_ids == ref
    s = res.stats
    assert s.predraft_hits == 0 and s.predraft_misses > 0 and s.early_frames >= s.rounds - 1
    # every miss falls back to proactive drafting: it drafted ahead while the round was in flight
    # and checked that work against the reply
    assert s.proactive_forwards > 0 and s.align_attempts >= s.predraft_misses


def test_seeded_sampling_with_predrafts_follows_the_target_only_sample_path(target, draft):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    res = run(target, draft, params, mode="proactive")
    assert res.token_ids == reference_decode(target, PROMPT, params, EOS)
    assert res.stats.predraft_hits > 0  # the exit walks with the round's own uniforms: same samples


def test_no_early_results_without_exit_heads(target, draft):
    """A server without exit heads does not advertise them: the agent never sets F_EARLY."""
    eng = VerifierEngine(target, eos_token_ids=EOS)
    agent = EdgeAgent(LocalTransport(eng), ModelDrafter(draft), config=AgentConfig(predraft=True))
    try:
        res = asyncio.run(agent.generate(PROMPT, GREEDY))
    finally:
        agent.close()
    assert res.token_ids == reference_decode(target, PROMPT, GREEDY, EOS)
    assert res.stats.early_frames == 0


def test_plain_decoding_rounds_ask_for_no_early_results(target, draft):
    """A zero budget hint (no trees pay) means plain decoding: no F_EARLY, nothing pre-drafted."""
    eng = VerifierEngine(target, eos_token_ids=EOS)
    eng.exit_heads = ExitHeads.init(target, (2,), rank=4)
    agent = EdgeAgent(LocalTransport(eng, budget_hint=0), ModelDrafter(draft), config=AgentConfig(predraft=True))
    try:
        res = asyncio.run(agent.generate(PROMPT, GREEDY))
    finally:
        agent.close()
    assert res.token_ids == reference_decode(target, PROMPT, GREEDY, EOS)
    assert res.stats.early_frames == 0 and res.stats.predraft_forwards == 0
