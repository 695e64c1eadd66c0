"""The ``auto`` verification rule (issue 17): the temperature prior from the measured benchmark,
measured acceptance (tokens per verify round trip) taking over, exploration, the state file, and
the agent choosing and learning per request over LocalTransport with the real engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from specdec.engine import VerifierEngine
from specdec.sampling import SamplingParams
from specdec.tree import TreeLimits
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.transport import LocalTransport
from edge_agent.verify_policy import PRIOR, SAMPLED_RULES, PolicyStore, VerifyPolicy, default_state_path, prior
from tests.edge_agent.test_agent import EOS, PROMPT

T07, T10 = SamplingParams(temperature=0.7), SamplingParams(temperature=1.0)


def test_greedy_is_match_and_the_prior_follows_the_benchmark_rows():
    pol = VerifyPolicy()
    assert pol.choose(SamplingParams()) == "match" and not pol.requests  # greedy: no sampled request counted
    assert pol.choose(T07) == "match"  # 1.79 vs 1.54 / 1.58 tokens per round
    assert pol.choose(T10) == "match"  # 1.48 vs 1.45 / 1.47
    assert prior("rejection", 0.85) == pytest.approx((PRIOR[0.7]["rejection"] + PRIOR[1.0]["rejection"]) / 2)
    assert prior("tree-rejection", 0.3) == PRIOR[0.7]["tree-rejection"]  # below the measured range: T = 0.7's
    assert prior("match", 1.6) == PRIOR[1.0]["match"]  # above it: T = 1.0's
    pol.observe("tree-rejection", T10, tokens=32.0, rounds=20)  # 1.6 measured: a little evidence beats 1.48
    assert pol.choose(T10) == "tree-rejection" and pol.choose(T07) == "match"  # per temperature


def test_measured_acceptance_outweighs_the_prior_and_the_others_are_explored():
    pol = VerifyPolicy(explore_every=4)
    rate = {"match": 1.3, "rejection": 2.6, "tree-rejection": 1.9}  # this pair: chains accept most
    seen = []
    for _ in range(16):
        rule = pol.choose(T07)
        seen.append(rule)
        pol.observe(rule, T07, tokens=rate[rule] * 20, rounds=20)
    assert seen[0] == "match"  # the prior, before anything is measured
    assert seen[:3] == ["match", "tree-rejection", "tree-rejection"]  # one measured generation outweighs the prior
    assert seen[3] == "rejection" and "match" in seen[4:]  # explorations: the rule with the least evidence
    kept = [r for i, r in enumerate(seen[4:], 5) if i % 4]
    assert kept == ["rejection"] * len(kept)  # once measured, the best is kept between explorations
    # the decayed evidence (~67 round trips) against the prior's 8: close to the measured 2.6
    assert 2.4 < pol.estimate("rejection", 0.7) < 2.6 and pol.estimate("match", 0.7) < 1.5
    assert pol.choose(T10) == "match"  # another temperature: its own prior, nothing measured there


def test_short_and_greedy_generations_are_not_evidence():
    pol = VerifyPolicy()
    pol.observe("rejection", T07, tokens=9.0, rounds=1)  # below min_rounds
    pol.observe("match", SamplingParams(), tokens=90.0, rounds=10)  # greedy
    assert not pol.evidence
    pol.observe("rejection", T07, tokens=40.0, rounds=10)
    pol.observe("rejection", T07, tokens=10.0, rounds=10)  # the older generation decays
    tok, n = pol.evidence[("rejection", 0.7)]
    assert n == pytest.approx(17.0) and tok == pytest.approx(38.0)


def test_the_store_keeps_each_pairs_evidence_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "sub" / "state.json"
    store = PolicyStore(path)
    a = VerifyPolicy()
    a.observe("tree-rejection", T10, tokens=60.0, rounds=20)
    a.choose(T10)
    store.save("target|draft-a", a)
    b = VerifyPolicy()
    b.observe("match", T07, tokens=30.0, rounds=20)
    store.save("target|draft-b", b)
    again = VerifyPolicy()
    store.load("target|draft-a", again)
    assert again.evidence == a.evidence and again.requests == {1.0: 1}
    other = VerifyPolicy()
    store.load("target|draft-b", other)
    assert set(other.evidence) == {("match", 0.7)}
    doc = json.loads(path.read_text())
    doc["pairs"]["target|draft-a"]["evidence"].append({"rule": "nonsense", "temperature": 1.0, "tokens": 1,
                                                        "rounds": 1})
    doc["pairs"]["target|draft-a"]["evidence"].append({"rule": "match"})
    path.write_text(json.dumps(doc))
    third = VerifyPolicy()
    store.load("target|draft-a", third)
    assert third.evidence == a.evidence  # unparsable entries are skipped
    path.write_text("{not json")
    fresh = VerifyPolicy()
    store.load("target|draft-a", fresh)
    assert not fresh.evidence  # an unreadable file is an empty one
    store.save("target|draft-a", a)  # and is replaced
    assert json.loads(path.read_text())["version"] == 1 and not list(path.parent.glob("*.tmp"))


def test_default_state_path_is_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_state_path() == tmp_path / "specedge" / "verify_policy.json"


@pytest.fixture(scope="module")
def engine(target):
    return VerifierEngine(target, eos_token_ids=EOS, limits=TreeLimits(max_nodes=64, max_depth=16))


def _generate(engine, draft, params_list, **cfg):
    async def main():
        agent = EdgeAgent(LocalTransport(engine), ModelDrafter(draft, name="noisy"),
                          config=AgentConfig(verify="auto", mode="stop-and-wait", depth_policy="fixed", depth=3,
                                             ping_every=0, **cfg))
        try:
            return [await agent.generate(PROMPT, p) for p in params_list], agent
        finally:
            agent.close()

    return asyncio.run(main())


def test_the_agent_picks_by_temperature_learns_and_keeps_it_in_the_state_file(engine, draft, tmp_path):
    state = tmp_path / "auto.json"
    sampled = [SamplingParams(temperature=t, seed=s, max_tokens=24, ignore_eos=True) for t, s in ((1.0, 1), (0.7, 2))]
    (hot, warm), agent = _generate(engine, draft, sampled, verify_state=str(state))
    assert hot.stats.verify_rule == "match" and warm.stats.verify_rule == "match"  # the prior
    for r in (hot, warm):
        assert len(r.token_ids) == 24 and r.stats.accepted_tokens > 0  # sampled rounds accept draft tokens
    tok, n = agent.verify_policy.evidence[("match", 1.0)]
    assert n == hot.stats.rounds and tok == hot.stats.accepted_tokens + hot.stats.rounds
    pair = next(iter(json.loads(state.read_text())["pairs"]))
    assert pair.endswith("|noisy")  # one entry per (target, draft)
    pol = VerifyPolicy()
    PolicyStore(state).load(pair, pol)
    assert pol.evidence == agent.verify_policy.evidence  # what the first agent learned was kept
    for rule in ("rejection", "tree-rejection"):  # another process measured this rule accepting far more
        pol.evidence = {k: v for k, v in pol.evidence.items() if k[0] == "match"}
        pol.evidence[(rule, 1.0)] = [400.0, 100.0]
        PolicyStore(state).save(pair, pol)
        (res,), agent2 = _generate(engine, draft, sampled[:1], verify_state=str(state))
        assert res.stats.verify_rule == rule and len(res.token_ids) == 24 and res.stats.accepted_tokens > 0
        assert agent2.verify_policy.evidence[(rule, 1.0)][1] > 70  # the decayed 100 + this generation's rounds
    (res,), _ = _generate(engine, draft, sampled[:1])  # no state file: the prior again
    assert res.stats.verify_rule == "match"
    assert set(SAMPLED_RULES) >= {k[0] for k in agent2.verify_policy.evidence}
