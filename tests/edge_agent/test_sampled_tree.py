"""Sampled trees (tree rejection sampling) at the edge, the agent's tree-rejection and auto rules.

The agent runs end to end over LocalTransport with the real engine: greedy requests equal
target-only decoding; sampled generations finish, re-open after losses and repeat exactly with a
seed; on an 8-token vocabulary the emitted tokens follow the target's marginals (chi-square).
"""

from __future__ import annotations

import pytest

from specdec.engine import VerifierEngine
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from specdec.tree import TreeLimits
from edge_agent.agent import AgentConfig
from edge_agent.draft_backends import ModelDrafter
from edge_agent.sampled_tree import PRIOR_RATES, plan_shape
from edge_agent.transport import LocalTransport
from tests.edge_agent.helpers import marginal, sampled_generations, sequence_probs
from tests.edge_agent.test_agent import EOS, PROMPT, run_agent
from tests.specdec.test_engine import counts_of
from tests.specdec.test_sampling import chi_square_pvalue

FIXED = dict(verify="tree-rejection", mode="stop-and-wait", depth_policy="fixed", depth=3, ping_every=0)


@pytest.mark.parametrize("budget, depth, children, expand, size", [
    (8, 4, 4, 8, 8), (32, 6, 4, 8, 32), (16, 3, 2, 2, 2 + 4 + 4), (5, 1, 4, 8, 4), (0, 3, 4, 8, 0), (6, 0, 4, 8, 0)])
def test_planned_shapes_respect_the_limits(budget, depth, children, expand, size):
    plan = plan_shape(budget, depth, children, expand, list(PRIOR_RATES))
    assert len(plan) == size
    depths, kids = [], {}
    for i, p in enumerate(plan):
        assert p < i  # parents first
        depths.append(1 if p < 0 else depths[p] + 1)
        kids.setdefault(p, []).append(i)
    assert max(depths, default=0) <= depth and all(len(k) <= children for k in kids.values())
    for lvl in range(depth):  # one draft forward per level feeds at most ``expand`` nodes
        assert sum(1 for p in kids if (0 if p < 0 else depths[p]) == lvl) <= expand
    assert depths == sorted(depths)  # level order: each level is fed by one forward


@pytest.fixture(scope="module")
def engine(target):
    return VerifierEngine(target, eos_token_ids=EOS, limits=TreeLimits(max_nodes=64, max_depth=16))


def test_greedy_requests_use_match_trees_and_equal_target_decoding(engine, draft, target):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = reference_decode(target, PROMPT, params, EOS)
    for rule in ("tree-rejection", "auto"):
        res, _ = run_agent(engine, ModelDrafter(draft), params, verify=rule)
        assert res.token_ids == want and res.stats.verify_rule == "match"


def test_sampled_trees_run_repeat_with_a_seed_and_survive_lost_sessions(engine, draft):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    first, transport = run_agent(engine, ModelDrafter(draft), params, **FIXED)
    st = first.stats
    assert len(first.token_ids) == 40 and st.verify_rule == "tree-rejection" and st.finish_reason == "length"
    assert st.accepted_tokens > 10 and st.draft_tokens > st.rounds  # trees, and they are accepted
    again, _ = run_agent(engine, ModelDrafter(draft), params, **FIXED)
    assert again.token_ids == first.token_ids

    def drop(t: LocalTransport, sid: str, rnd: int):
        if rnd in (1, 2, 6):
            t.drop_session(sid, evicted=rnd != 2)

    res, _ = run_agent(engine, ModelDrafter(draft), params, before_verify=drop, **FIXED)
    assert len(res.token_ids) == 40 and res.stats.reopens == 3
    assert not engine.sessions


@pytest.mark.slow  # ~35 s on 2 shared cores (as the chain rule's agent test); the engine's tests are in make test
def test_tree_rejection_through_the_agent_follows_the_target():
    """End to end (the agent's sampled trees, proposals on the wire, the server's residuals) on an
    8-token vocabulary: tokens 1-2 and 3-4 of 4 follow the target's marginals."""
    v, length, n = 8, 4, 700
    small = tiny_random_model(seed=1, vocab_size=v)
    eng = VerifierEngine(small, eos_token_ids=())
    prompt, t = [3, 5, 7, 1], SamplingParams(temperature=1.0)

    results = sampled_generations(small, eng, AgentConfig(**{**FIXED, "depth": 2, "budget": 6}), prompt, n, length)
    assert sum(r.stats.accepted_tokens for r in results) > 300
    joint = sequence_probs(small, prompt, t, length)
    for a, b in ((0, 1), (2, 3)):
        counts = counts_of(tuple(r.token_ids[a: b + 1]) for r in results)
        assert chi_square_pvalue(counts, marginal(joint, a, b + 1)) > 1e-3, (a, b)
