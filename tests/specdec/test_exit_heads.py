"""Exit heads and early results mid-forward (specdec/exit_heads.py) on tiny random models.

Lossless with early exits on: greedy token equality with target-only decoding, the seeded
sample path of target-only decoding, and the chi-square test of the sampled distribution;
early results arrive during the forward (before the engine's forward callback), and an exit
that always disagrees with the last layer changes nothing in the output.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec import exit_heads as eh
from specdec.acceptance import walk_tree
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest, VerifyResult
from specdec.exit_heads import EarlyResult, ExitHeads, SubsetRows, early_walk
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams, make_generator
from specdec.tree import DraftTree
from tests.specdec.test_engine import (EOS, STAT_PROMPT, STAT_ROOT, V_STAT, counts_of, exact_two_token_joint,
                                        expected_walk, random_prompt, random_tree, stat_tree)
from tests.specdec.test_sampling import chi_square_pvalue


@pytest.fixture(scope="module")
def model4():
    return tiny_random_model(seed=3, num_layers=4)


def early_engine(model, layers=(1, 2), ids=None, eos=(EOS,)) -> VerifierEngine:
    eng = VerifierEngine(model, eos_token_ids=eos)
    eng.exit_heads = ExitHeads.init(model, layers, rank=8, ids=ids)
    return eng


def run_sessions(eng: VerifierEngine, specs: dict, rng: random.Random, events: list) -> dict[str, list[int]]:
    """Rounds of random trees with early results on, until every session finishes."""
    res = eng.open([OpenRequest(sid, p, prm) for sid, (p, prm, _) in specs.items()])
    out = {sid: [r.first_token] for sid, r in zip(specs, res)}
    while True:
        live = [sid for sid in specs if not eng.sessions[sid].finished]
        if not live:
            return out
        reqs = []
        for sid in live:
            s = eng.sessions[sid]
            truth = specs[sid][2][s.num_generated:]
            reqs.append(VerifyRequest(sid, random_tree(rng, truth, eng.vocab_size, 24, 6), len(s.prefix),
                                      early=True))
        results = eng.verify(reqs, on_early=lambda rs: events.append(("early", rs)))
        events.append(("final", results))
        for r in results:
            assert isinstance(r, VerifyResult), r
            out[r.sid] += list(r.tokens)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_with_early_exits_equals_target_only_decoding(model4, seed):
    rng = random.Random(seed)
    V = model4.config.vocab_size
    specs = {}
    for i in range(rng.randint(1, 4)):
        prompt, params = random_prompt(rng, V), SamplingParams(max_tokens=rng.randint(2, 30))
        specs[f"s{i}"] = (prompt, params, reference_decode(model4, prompt, params, (EOS,)))
    eng = early_engine(model4)
    events = []
    out = run_sessions(eng, specs, rng, events)
    for sid, (_, _, ref) in specs.items():
        assert out[sid] == ref, sid
    # every round: the early results of both exits, before the final reply
    for k in range(0, len(events), 3):
        (a, ra), (b, rb), (c, rc) = events[k: k + 3]
        assert (a, b, c) == ("early", "early", "final")
        assert {r.layer for r in ra} == {1} and {r.layer for r in rb} == {2}
        assert sorted(r.sid for r in ra) == sorted(r.sid for r in rc)
        assert all(0.0 <= r.confidence <= 1.0 for r in ra + rb)


def test_early_results_are_computed_mid_forward(model4):
    """The sink runs inside the forward: before the engine's per-forward callback fires."""
    order = []
    eng = VerifierEngine(model4, eos_token_ids=(EOS,), on_forward=lambda st: order.append(("forward", st.kind)))
    eng.exit_heads = ExitHeads.init(model4, (2,), rank=8)
    (r,) = eng.open([OpenRequest("a", [5, 6, 7], SamplingParams(max_tokens=8))])
    order.clear()
    eng.verify([VerifyRequest("a", DraftTree((5, 6), (-1, 0)), 4, early=True)],
               on_early=lambda rs: order.append(("early", rs[0].layer)))
    assert order == [("early", 2), ("forward", "verify")]
    # a request without ``early`` gets none
    order.clear()
    eng.verify([VerifyRequest("a", DraftTree((5,), (-1,)), len(eng.sessions["a"].prefix))],
               on_early=lambda rs: order.append("early"))
    assert "early" not in order


def test_the_measured_cost_of_the_exits_includes_the_sink(model4):
    """The hook's seconds count handing the frames to the sink (the replica encodes and queues
    them there), in wall time and in the forward thread's CPU time."""
    import time

    def spin_sink(results):  # 30 ms of this thread's CPU, then 50 ms asleep (wall only)
        c0 = time.thread_time()
        while time.thread_time() - c0 < 0.03:
            pass
        time.sleep(0.05)

    eng = early_engine(model4, layers=(2,))
    eng.open([OpenRequest("a", [5, 6, 7], SamplingParams(max_tokens=8))])
    eng.verify([VerifyRequest("a", DraftTree((5, 6), (-1, 0)), 4, early=True)], on_early=spin_sink)
    hook = eng.last_early
    assert hook.seconds >= 0.08 and 0.03 <= hook.cpu_seconds < hook.seconds


def test_early_walk_with_the_final_logits_is_the_final_walk(model4):
    """The early walk is the final walk's rule on a copy of the generator: fed the final
    logits, it gives the same path and token, and leaves the session's generator as it was."""
    rng = random.Random(0)
    V = model4.config.vocab_size
    for trial in range(20):
        tree = random_tree(rng, [], V, 12, 4)
        logits = torch.randn(len(tree) + 1, V)
        params = SamplingParams(temperature=0.8, seed=trial) if trial % 2 else SamplingParams()
        g = make_generator(params)
        state = g.get_state().clone() if g is not None else None
        acc, tok, conf = early_walk(tree, SubsetRows(logits, torch.arange(V), V), params, g, None, frozenset())
        if g is not None:
            assert torch.equal(g.get_state(), state)  # untouched
        final = walk_tree(tree, logits, params, g)
        assert (acc, tok) == (final.accepted, final.bonus)
        assert 0.0 < conf <= 1.0


def test_an_exit_that_always_disagrees_changes_nothing(model4):
    """Forced early/final disagreement: the exit predicts over one token the target never picks."""
    rng = random.Random(5)
    V = model4.config.vocab_size
    prompt, params = random_prompt(rng, V), SamplingParams(max_tokens=20)
    ref = reference_decode(model4, prompt, params, (EOS,))
    bad = next(t for t in range(3, V) if t not in ref)
    eng = early_engine(model4, layers=(1,), ids=torch.tensor([bad]))
    events = []
    out = run_sessions(eng, {"a": (prompt, params, ref)}, rng, events)
    assert out["a"] == ref
    early = [r for kind, rs in events if kind == "early" for r in rs]
    assert early and all(r.token == bad and r.accepted == () for r in early)


def seeded_run(model) -> tuple[list[int], list[int]]:
    """(output with early exits on, target-only reference) of one seeded sampled session."""
    rng = random.Random(1)
    prompt = random_prompt(rng, model.config.vocab_size)
    params = SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=24)
    ref = reference_decode(model, prompt, params, (EOS,))
    return run_sessions(early_engine(model), {"a": (prompt, params, ref)}, rng, [])["a"], ref


def test_seeded_sampling_with_early_exits_follows_the_reference_sample_path(model4):
    out, ref = seeded_run(model4)
    assert out == ref


def test_the_sample_path_test_catches_an_early_walk_on_the_sessions_generator(model4, monkeypatch):
    """Test of the test: an early walk that draws from the session's own generator (no copy)
    shifts its uniforms, and the sample path leaves the reference's."""
    def consuming(tree, rows, params, generator, max_emit, stop_ids):
        acc = walk_tree(tree, rows, params, generator, max_emit=max_emit, stop_ids=stop_ids)
        return acc.accepted, acc.bonus, 1.0

    monkeypatch.setattr(eh, "early_walk", consuming)
    out, ref = seeded_run(model4)
    assert out != ref


@pytest.fixture(scope="module")
def model_small():
    return tiny_random_model(seed=1, vocab_size=V_STAT, num_layers=3)


def sample_two_tokens_with_early(model, params: SamplingParams, sessions: int = 1500):
    """``tests/specdec/test_engine.py``'s two-token experiment with exit heads on every request."""
    eng = early_engine(model, layers=(1, 2), eos=())
    sids = [f"x{i}" for i in range(sessions)]
    eng.open([OpenRequest(sid, STAT_PROMPT, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                            top_p=params.top_p, seed=i, max_tokens=8),
                          generated=(STAT_ROOT,)) for i, sid in enumerate(sids)])
    tree = stat_tree(model)
    early: list[EarlyResult] = []
    reqs = [VerifyRequest(sid, tree, len(STAT_PROMPT) + 1, early=True) for sid in sids]
    while reqs:
        eng.verify(reqs, on_early=early.extend)
        reqs = [VerifyRequest(sid, DraftTree((1, 2), (-1, -1)), len(eng.sessions[sid].prefix), early=True)
                for sid in sids if eng.sessions[sid].num_generated < 3]
    assert len(early) >= 2 * sessions
    return [tuple(eng.sessions[sid].prefix[eng.sessions[sid].prompt_len:][1:3]) for sid in sids]


def test_tree_verification_with_early_exits_samples_the_target_distribution(model_small):
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    samples = sample_two_tokens_with_early(model_small, params)
    assert chi_square_pvalue(counts_of(samples), exact_two_token_joint(model_small, params)) > 1e-3


def test_exit_heads_round_trip_through_an_artifact(model4, tmp_path):
    heads = ExitHeads.init(model4, (1, 3), rank=4, ids=torch.arange(0, 100))
    torch.nn.init.normal_(heads.adapters[3].up)
    p = heads.save(tmp_path / "heads", {"note": "test"})
    back = ExitHeads.load(p, model4, layers=(3,))
    h = torch.randn(5, model4.config.hidden_size)
    assert back.layers == (3,) and torch.equal(back.ids, heads.ids)
    # stored in bf16: the same logits to bf16 rounding
    assert torch.allclose(back.logits(3, h), heads.logits(3, h), atol=0.1, rtol=0.05)
    with pytest.raises(ValueError):
        ExitHeads.load(p, model4, layers=(2,))
    with pytest.raises(ValueError):
        ExitHeads.load(p, tiny_random_model(seed=0, num_layers=2), layers=(1,))
    with pytest.raises(ValueError):
        ExitHeads.init(model4, (4,))


def test_the_early_statistic_catches_a_wrong_acceptance_rule(model_small, monkeypatch):
    """Test of the test: with early exits on, a 'child in the target's top-2' final rule fails it."""
    from specdec import engine as engine_module
    from tests.specdec.test_acceptance import wrong_top2

    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    monkeypatch.setattr(engine_module, "walk_tree", wrong_top2)
    samples = sample_two_tokens_with_early(model_small, params)
    assert chi_square_pvalue(counts_of(samples), exact_two_token_joint(model_small, params)) < 1e-6
