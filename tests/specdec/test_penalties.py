"""Penalties (presence, frequency, repetition) through tree verification: greedy output equals
penalised target-only decoding, sampled output follows the penalised distribution, and a walk
that penalises with the wrong history (the session's, not each node's own) fails the statistic."""

from __future__ import annotations

import random

import pytest
import torch

from specdec import penalties as penalties_module
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
from specdec.penalties import Penalties
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams, target_probs
from specdec.tree import DraftTree
from tests.specdec.test_chain_verify import sample_two_tokens_via_chain
from tests.specdec.test_engine import (EOS, STAT_PROMPT, STAT_ROOT, STAT_SESSIONS, V_STAT, counts_of, drive,
                                        generated, model_small, random_prompt, stat_tree)  # noqa: F401
from tests.specdec.test_sampling import chi_square_pvalue

PENALISED = [SamplingParams(presence_penalty=1.5), SamplingParams(frequency_penalty=0.7),
             SamplingParams(repetition_penalty=1.8),
             SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3)]


def vllm_penalised(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's apply_penalties written out token by token (independent of Penalties)."""
    x = logits.float().clone()
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x


@pytest.mark.parametrize("params", PENALISED, ids=["presence", "frequency", "repetition", "all"])
def test_penalties_are_vllms(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    prompt, output = [1, 2, 3, 3], [3, 7, 7, 9, 7]
    pen = Penalties(params, prompt, output[:2], 50)
    assert torch.allclose(pen.apply(logits, output[2:]), vllm_penalised(logits, params, prompt, output))
    assert torch.equal(pen.apply(logits, output[2:]), Penalties(params, prompt, output, 50).apply(logits))


@pytest.mark.parametrize("seed", range(3))
def test_greedy_with_penalties_through_trees_equals_penalised_decoding(tiny_model, seed):
    rng = random.Random(seed)
    V = tiny_model.config.vocab_size
    specs, changed = {}, 0
    for i, base in enumerate(PENALISED):
        params = SamplingParams(max_tokens=30, presence_penalty=base.presence_penalty,
                                frequency_penalty=base.frequency_penalty, repetition_penalty=base.repetition_penalty)
        prompt = random_prompt(rng, V, 2, 20)
        want = reference_decode(tiny_model, prompt, params, (EOS,))
        changed += want != reference_decode(tiny_model, prompt, SamplingParams(max_tokens=30), (EOS,))
        specs[f"p{i}"] = (prompt, params, want)
    assert changed >= 2  # the penalties change the output: the comparison can fail
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    opened = eng.open([OpenRequest(sid, p, prm) for sid, (p, prm, _) in specs.items()])
    assert [r.first_token for r in opened] == [w[0] for _, _, w in specs.values()]
    drive(eng, {sid: v[2] for sid, v in specs.items()}, rng)  # checks every round against the truth
    for sid, (_p, _prm, want) in specs.items():
        assert generated(eng, sid) == want


STAT_PARAMS = SamplingParams(temperature=1.0, presence_penalty=-1.5, frequency_penalty=-0.5, repetition_penalty=1.2)


def exact_penalised_joint(model, params: SamplingParams) -> dict[tuple[int, int], float]:
    """The penalised target's next two tokens after STAT_PROMPT with STAT_ROOT generated."""
    ctx = STAT_PROMPT + [STAT_ROOT]
    with torch.inference_mode():
        l1 = model(torch.tensor([ctx])).logits[0, -1]
        p1 = target_probs(vllm_penalised(l1, params, STAT_PROMPT, [STAT_ROOT]), params)  # [V]
        l2 = model(torch.tensor([ctx + [x] for x in range(V_STAT)])).logits[:, -1]  # [V, V]
        p2 = [target_probs(vllm_penalised(l2[a], params, STAT_PROMPT, [STAT_ROOT, a]), params) for a in range(V_STAT)]
    return {(a, b): float(p1[a] * p2[a][b]) for a in range(V_STAT) for b in range(V_STAT)}


def sample_two_penalised(model, params: SamplingParams) -> list[tuple[int, int]]:
    eng = VerifierEngine(model, eos_token_ids=())
    sids = [f"x{i}" for i in range(STAT_SESSIONS)]
    eng.open([OpenRequest(sid, STAT_PROMPT, SamplingParams(**{**params.to_dict(), "seed": i, "max_tokens": 8}),
                          generated=(STAT_ROOT,)) for i, sid in enumerate(sids)])
    reqs = [VerifyRequest(sid, stat_tree(model), len(STAT_PROMPT) + 1) for sid in sids]
    while reqs:
        eng.verify(reqs)
        reqs = [VerifyRequest(sid, DraftTree((1, 2), (-1, -1)), len(eng.sessions[sid].prefix))
                for sid in sids if eng.sessions[sid].num_generated < 3]
    return [tuple(generated(eng, sid)[1:3]) for sid in sids]


def test_sampled_tokens_with_penalties_follow_the_penalised_target(model_small):
    joint = exact_penalised_joint(model_small, STAT_PARAMS)
    plain = exact_penalised_joint(model_small, SamplingParams(temperature=1.0))
    assert sum(abs(joint[k] - plain[k]) for k in joint) > 0.2  # the penalties move the distribution
    assert chi_square_pvalue(counts_of(sample_two_penalised(model_small, STAT_PARAMS)), joint) > 1e-3


def test_the_statistic_catches_penalties_with_the_wrong_history(model_small, monkeypatch):
    """Test of the test: penalising every node with the session's history alone (ancestors ignored) fails."""
    right = penalties_module.Penalties.apply
    monkeypatch.setattr(penalties_module.Penalties, "apply", lambda self, logits, extra=(): right(self, logits))
    samples = sample_two_penalised(model_small, STAT_PARAMS)
    assert chi_square_pvalue(counts_of(samples), exact_penalised_joint(model_small, STAT_PARAMS)) < 1e-6


def test_chain_rejection_sampling_with_penalties_follows_the_penalised_target(model_small):
    """Chain mode (DSSD split): each chain position's p is penalised after the chain tokens before it (the
    penalised joint is far from the plain one: test_sampled_tokens_with_penalties_follow_the_penalised_target)."""
    samples = sample_two_tokens_via_chain(model_small, STAT_PARAMS)
    assert chi_square_pvalue(counts_of(samples), exact_penalised_joint(model_small, STAT_PARAMS)) > 1e-3


def sample_two_via_tree_rejection(model, params: SamplingParams) -> list[tuple[int, int]]:
    """Tree rejection sampling (issue 17's rule); the test plays the edge: every sibling set drawn
    without replacement from a context-free draft q's proposal, sent with the tree."""
    from specdec.proposal import draw_without_replacement, make_proposal

    q = torch.softmax(torch.linspace(1.5, -1.5, V_STAT), 0)  # [V]
    prop = make_proposal(q, V_STAT)
    g = torch.Generator().manual_seed(77)
    eng = VerifierEngine(model, eos_token_ids=())
    sids = [f"r{i}" for i in range(2 * STAT_SESSIONS)]  # the wrong history sits near 1e-6 at STAT_SESSIONS
    eng.open([OpenRequest(sid, STAT_PROMPT, SamplingParams(**{**params.to_dict(), "seed": i, "max_tokens": 8}),
                          generated=(STAT_ROOT,)) for i, sid in enumerate(sids)])

    def tree(depth2: bool):
        kids = draw_without_replacement(prop, 3, g)
        tokens, parents, props = list(kids), [-1] * 3, [(prop.ids, prop.weights)] + [None] * 3
        if depth2:
            tokens += draw_without_replacement(prop, 2, g)
            parents += [0, 0]
            props[1] = (prop.ids, prop.weights)
            props += [None, None]
        return DraftTree(tuple(tokens), tuple(parents)), tuple(props)

    reqs = []
    for sid in sids:
        t, props = tree(True)
        reqs.append(VerifyRequest(sid, t, len(STAT_PROMPT) + 1, proposals=props))
    while reqs:
        eng.verify(reqs)
        reqs = []
        for sid in sids:
            if eng.sessions[sid].num_generated < 3:
                t, props = tree(False)
                reqs.append(VerifyRequest(sid, t, len(eng.sessions[sid].prefix), proposals=props))
    return [tuple(generated(eng, sid)[1:3]) for sid in sids]


def test_tree_rejection_sampling_with_penalties_follows_the_penalised_target(model_small):
    samples = sample_two_via_tree_rejection(model_small, STAT_PARAMS)
    assert chi_square_pvalue(counts_of(samples), exact_penalised_joint(model_small, STAT_PARAMS)) > 1e-3


def test_the_tree_rejection_statistic_catches_the_wrong_history(model_small, monkeypatch):
    """Test of the test: each node penalised with the session's history alone fails."""
    right = penalties_module.Penalties.apply
    monkeypatch.setattr(penalties_module.Penalties, "apply", lambda self, logits, extra=(): right(self, logits))
    samples = sample_two_via_tree_rejection(model_small, STAT_PARAMS)
    assert chi_square_pvalue(counts_of(samples), exact_penalised_joint(model_small, STAT_PARAMS)) < 1e-6
