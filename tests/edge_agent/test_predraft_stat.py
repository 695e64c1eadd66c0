"""The sampled output of the agent with pre-drafting on is the target's distribution (issue 19,
"the sampling chi-square test with early exits on", at the agent level).

A tiny target over 8 tokens, an untrained exit after layer 1 of 3 (its guesses are right in some
rounds and wrong in others: pre-draft hits and misses mixed), a noisy draft, many seeded
generations of 4 tokens from one prompt, run concurrently over one LocalTransport with an RTT
(the edge pre-drafts while a round is away). The joint of generated tokens 2 and 3 (which come
from verify rounds, after pre-drafted trees or fallbacks) must fit the target's exact joint,
marginalised over the first token; the same experiment with a wrong acceptance rule must not.
"""

from __future__ import annotations

import asyncio

import pytest

from specdec.engine import VerifierEngine
from specdec.exit_heads import ExitHeads
from specdec.model.loading import tiny_random_model
from specdec.sampling import SamplingParams
from specdec.tree import TreeLimits
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.transport import LocalTransport
from tests.edge_agent.helpers import marginal, noisy_copy, sequence_probs
from tests.specdec.test_engine import counts_of
from tests.specdec.test_sampling import chi_square_pvalue

V = 8
PROMPT = [3, 5, 7, 1, 4]
SAMPLES = 1200
SAMPLES_WRONG_RULE = 300  # the wrong rule's p-value is ~1e-96 at 400 samples already
CONCURRENT = 24


def params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=6, top_p=0.95, seed=seed, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return tiny_random_model(seed=1, vocab_size=V, num_layers=3)


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, 0.05)


def exact_joint_of_tokens_2_3(model) -> dict[tuple[int, int], float]:
    """P(t2, t3) after PROMPT: sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2)."""
    return marginal(sequence_probs(model, PROMPT, params(0), 3), 1, 3)


def sample_with_predraft(target, draft, samples: int = SAMPLES):
    eng = VerifierEngine(target, eos_token_ids=(), limits=TreeLimits(max_nodes=32, max_depth=8))
    eng.exit_heads = ExitHeads.init(target, (1,), rank=4)
    transport = LocalTransport(eng, rtt_ms=20.0)

    async def main():
        seeds = iter(range(samples))
        out = {}

        async def edge():  # one agent (one draft model state) per concurrent edge, its generations in turn
            agent = EdgeAgent(transport, ModelDrafter(draft),
                              config=AgentConfig(predraft=True, mode="proactive", depth_policy="fixed", depth=2))
            try:
                for seed in seeds:
                    out[seed] = await agent.generate(PROMPT, params(seed))
            finally:
                agent.close()
        await asyncio.gather(*(edge() for _ in range(CONCURRENT)))
        return [out[i] for i in range(samples)]

    results = asyncio.run(main())
    hits = sum(r.stats.predraft_hits for r in results)
    misses = sum(r.stats.predraft_misses for r in results)
    reused = sum(r.stats.reused_tokens for r in results)  # proactive tokens carried into the next tree
    return [tuple(r.token_ids[1:3]) for r in results], hits, misses, reused


def test_sampled_output_with_predrafting_is_the_targets_distribution(target, draft):
    samples, hits, misses, reused = sample_with_predraft(target, draft)
    assert hits > 50 and misses > 50 and reused > 10  # pre-draft hits, misses, proactive alignment: all ran
    assert chi_square_pvalue(counts_of(samples), exact_joint_of_tokens_2_3(target)) > 1e-3


def test_the_agent_statistic_catches_a_wrong_acceptance_rule(target, draft, monkeypatch):
    """Test of the test: the replica accepting any child in the target's top-2 fails it."""
    from specdec import engine as engine_module
    from tests.specdec.test_acceptance import wrong_top2

    monkeypatch.setattr(engine_module, "walk_tree", wrong_top2)
    samples, *_ = sample_with_predraft(target, draft, SAMPLES_WRONG_RULE)
    assert chi_square_pvalue(counts_of(samples), exact_joint_of_tokens_2_3(target)) < 1e-6
