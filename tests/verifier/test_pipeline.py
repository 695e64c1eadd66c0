"""Pipeline-parallel verifier: bit-identical to the unsharded one, KV rollback across stages.

The stage actors build the same tiny random model from the same seed as the driver
(fp32); the engine under test is ``VerifierEngine(model, runner=PipelineRunner(...))``,
the reference ``VerifierEngine(model)`` with a plain in-process ModelRunner.

Bit-identical logits need the same number of torch threads on both sides: the CPU
GEMM splits the rows of a small matrix among threads, and a row computed by the tail
kernel instead of the main micro-kernel accumulates in another order (seen: a
[5, 64] x [64, 64] q_proj differs by ~1e-6 in row 4 between 1 and 2 threads). Stages
run 1 thread each here, so the reference does too (:func:`same_threads`).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from deploy.config import ModelConfig
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest, VerifyResult
from specdec.model.loading import load_model
from deploy.verifier.pipeline import pipeline_bundles, pipeline_deployment_options, stage_resources
from deploy.verifier.pipeline_stage import ModelShell
from specdec.model.batch import chunk_input, tree_input
from specdec.model.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree

TINY = ModelConfig(model="tiny-random", dtype="float32", seed=3, tiny_config={"num_layers": 6})


# -- placement (no Ray) -------------------------------------------------------------
def test_bundles_reserve_the_replica_then_one_bundle_per_stage():
    assert pipeline_bundles(1) is None
    assert pipeline_bundles(3, "cpu", cpus_per_stage=2) == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0}]
    gpu = pipeline_bundles(2, "cuda", cpus_per_stage=4, replica_cpus=2)
    assert gpu == [{"CPU": 2.0}, {"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}]
    assert stage_resources("cuda", 0, 1) == {"GPU": 1.0}
    with pytest.raises(ValueError):
        stage_resources("cpu", 0)
    with pytest.raises(ValueError):
        stage_resources("cuda", 1, 0)  # a CUDA stage without a GPU
    with pytest.raises(ValueError):
        pipeline_bundles(0)


def test_deployment_options_match_bundle_zero():
    opts = pipeline_deployment_options(4, "cuda", cpus_per_stage=2, replica_cpus=1)
    assert opts["ray_actor_options"] == {"num_cpus": 1.0}
    assert opts["placement_group_bundles"][0] == {"CPU": 1.0} and len(opts["placement_group_bundles"]) == 5
    assert opts["placement_group_strategy"] == "PACK"
    assert pipeline_deployment_options(1, "cuda") == {"ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1.0}}
    assert "placement_group_bundles" not in pipeline_deployment_options(1, "cpu")


# -- helpers ----------------------------------------------------------------------------
def _oracle_tree(model, prefix: list[int], rng: random.Random, vocab: int) -> DraftTree:
    """A tree around the target's greedy continuation (so paths get accepted), with wrong
    tokens and random siblings (so rollbacks happen); empty trees sometimes."""
    if rng.random() < 0.1:
        return DraftTree.empty()
    depth = rng.randint(1, 5)
    with torch.no_grad():
        ids = torch.tensor([prefix])
        chain = []
        for _ in range(depth):
            nxt = int(model(ids).logits[0, -1].argmax())
            if rng.random() < 0.25:
                nxt = rng.randrange(vocab)  # a wrong guess: the path stops here
            chain.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    # the chain nodes, each with 0-2 random siblings listed before it
    tokens, parents, chain_idx = [], [], []
    for i, t in enumerate(chain):
        parent = -1 if i == 0 else chain_idx[-1]
        for _ in range(rng.randint(0, 2)):  # siblings (random tokens)
            tokens.append(rng.randrange(vocab))
            parents.append(parent)
        chain_idx.append(len(tokens))
        tokens.append(t)
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def _run_sessions(engines, model, vocab, rounds: int, seed: int, sids: list[str], params_of):
    """Drive identical open/verify/close sequences through every engine; return their outputs."""
    rng = random.Random(seed)
    outs = [[] for _ in engines]
    prompts = {sid: [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))] for sid in sids}
    for outs_e, e in zip(outs, engines):
        outs_e.append(e.open([OpenRequest(s, prompts[s], params_of(s)) for s in sids]))
    ref = engines[0]
    for r in range(rounds):
        live = [s for s in sids if s in ref.sessions and not ref.sessions[s].finished]
        if not live:
            break
        batch = rng.sample(live, rng.randint(1, len(live)))
        reqs = [VerifyRequest(s, _oracle_tree(model, ref.sessions[s].prefix, rng, vocab), len(ref.sessions[s].prefix))
                for s in batch]
        for outs_e, e in zip(outs, engines):
            outs_e.append(e.verify(reqs))
        if r % 7 == 6:  # close one session and re-open it from its history (prefill of history[:-1])
            s = rng.choice(batch)
            hist = ref.sessions[s].prefix
            gen = tuple(hist[len(prompts[s]):])
            if not ref.sessions[s].finished and gen:
                for outs_e, e in zip(outs, engines):
                    e.close(s)
                    outs_e.append(e.open([OpenRequest(s, prompts[s], params_of(s), generated=gen)]))
    return outs


def _assert_same_kv(ref_runner: ModelRunner, pipe, sids):
    for s in sids:
        got = pipe.session_kv(s)
        kv = ref_runner.session_kv(s)
        if kv is None or kv[0].shape[2] == 0:
            assert got is None or got[0].shape[2] == 0, s
            continue
        assert got is not None, s
        assert torch.equal(got[0], kv[0]) and torch.equal(got[1], kv[1]), s
        assert pipe.kv_length(s) == kv[0].shape[2]


# -- Ray-backed tests ------------------------------------------------------------------
STAGE_THREADS = 1


@pytest.fixture(autouse=True)
def same_threads():
    """The in-process reference uses the stages' thread count (see the module docstring)."""
    before = torch.get_num_threads()
    torch.set_num_threads(STAGE_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny6():
    return load_model(TINY.model, dtype=TINY.dtype, seed=TINY.seed, tiny_config=TINY.tiny_config)


@pytest.fixture(scope="module", params=[2, 3], ids=["pp2", "pp3"])
def pipe(request, ray_session):
    from deploy.verifier.pipeline import PipelineRunner

    # stage pools with prefix caching: an engine without it never shares or caches a page there
    runner = PipelineRunner(TINY, request.param, cpus_per_stage=0.5, torch_threads=STAGE_THREADS, prefix_caching=True)
    yield runner
    runner.shutdown()


@pytest.mark.ray
def test_stage_layout_and_metadata(pipe, tiny6):
    assert pipe.slices[0][0] == 0 and pipe.slices[-1][1] == 6
    assert all(a < b for a, b in pipe.slices)
    shell = pipe.loaded.model
    assert isinstance(shell, ModelShell) and shell.config.vocab_size == tiny6.vocab_size
    assert pipe.loaded.eos_token_ids == tiny6.eos_token_ids
    stats = pipe.stage_stats()
    assert [(s["first"], s["last"]) for s in stats] == pipe.slices
    assert all(0 <= s["busy_s"] <= s["wall_s"] and s["torch_threads"] == STAGE_THREADS for s in stats)


@pytest.mark.ray
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_engine_results_bit_identical_to_unsharded(pipe, tiny6, sampling):
    model, vocab = tiny6.model, tiny6.vocab_size
    ref = VerifierEngine(model, eos_token_ids=tiny6.eos_token_ids)
    eng = VerifierEngine(model, eos_token_ids=tiny6.eos_token_ids, runner=pipe)
    sids = [f"{sampling}-{pipe.pipeline_parallel_size}-{i}" for i in range(12)]

    def params_of(sid):
        i = int(sid.rsplit("-", 1)[1])
        if sampling == "greedy":
            return SamplingParams(max_tokens=20 + 4 * i)
        return SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=20 + 4 * i)

    captured = {"ref": [], "pipe": []}  # every logits tensor both runners returned
    for name, e in (("ref", ref), ("pipe", eng)):
        fwd = e.runner.forward

        def spy(bid, items, _fwd=fwd, _name=name):
            out = _fwd(bid, items)
            captured[_name].append(out)
            return out
        e.runner.forward = spy
    try:
        outs = _run_sessions([ref, eng], model, vocab, rounds=40, seed=7, sids=sids, params_of=params_of)
    finally:
        del eng.runner.forward  # restore the class method on the shared runner
    assert outs[0] == outs[1]
    emitted = sum(len(r.tokens) for batch in outs[0] for r in batch if isinstance(r, VerifyResult))
    accepted = sum(len(r.accepted) for batch in outs[0] for r in batch if isinstance(r, VerifyResult))
    assert emitted > 60 and accepted > 10, (emitted, accepted)  # trees really walked, not just bonus tokens
    assert len(captured["ref"]) == len(captured["pipe"]) > 25
    for a, b in zip(captured["ref"], captured["pipe"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))  # bit-identical logits
    # KV after all rollbacks, per session and layer, equal to the unsharded runner's
    _assert_same_kv(ref.runner, pipe, sids)
    assert pipe.kv_tokens() == ref.runner.kv_tokens()
    for s in sids:
        eng.close(s)
    pipe.sync()
    assert pipe.kv_tokens() == 0 and all(st["kv_tokens"] == 0 for st in pipe.stage_stats())


@pytest.mark.ray
def test_prefix_caching_across_stages_equals_the_unsharded_engine_without_it(pipe, tiny6):
    """Every stage shares the same cached pages: a prompt that extends a finished session's starts
    on them, and its KV and first token are those of an unsharded engine that computed them all."""
    model, vocab = tiny6.model, tiny6.vocab_size
    ref = VerifierEngine(model, eos_token_ids=tiny6.eos_token_ids)
    eng = VerifierEngine(model, eos_token_ids=tiny6.eos_token_ids, runner=pipe, prefix_caching=True)
    rng = random.Random(5 + pipe.pipeline_parallel_size)  # a prompt no other run of this test cached
    a = [rng.randrange(3, vocab) for _ in range(40)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    firsts = []
    sa, sb = f"pc{pipe.pipeline_parallel_size}-a", f"pc{pipe.pipeline_parallel_size}-b"
    for e in (ref, eng):
        e.open([OpenRequest(sa, a, params)])
        while not e.sessions[sa].finished:  # its KV is cached as it finishes
            e.verify([VerifyRequest(sa, DraftTree.empty(), len(e.sessions[sa].prefix))])
        b = e.sessions[sa].prefix + [5, 6]
        firsts.append(e.open([OpenRequest(sb, b, params)])[0].first_token)
    assert eng.prefix_tokens[1] == 32 and firsts[0] == firsts[1]
    _assert_same_kv(ref.runner, pipe, [sb])
    eng.close(sb, cache=False)


@pytest.mark.ray
def test_truncate_and_failed_forward_across_stages(pipe, tiny6):
    ref = ModelRunner(tiny6.model)
    ids = list(range(10, 30))
    item = chunk_input("t", 0, ids)
    for r in (ref, pipe):
        r.forward(1, [item])
        r.commit(1, {"t": (20, [])})
        r.truncate("t", 13)  # roll back to a shorter prefix on every stage
    _assert_same_kv(ref, pipe, ["t"])
    with pytest.raises(ValueError):
        pipe.truncate("t", 14)
    # a failing forward (token id outside the vocabulary) raises and leaves the KV untouched
    bad = chunk_input("t", 13, [10 ** 6])
    with pytest.raises(Exception):
        pipe.forward(2, [bad])
    pipe.abort(2)
    nxt = tree_input("t", 13, 5, [6, 7], [-1, -1], [1, 1])  # the root and two siblings
    a, b = ref.forward(3, [nxt]), pipe.forward(3, [nxt])
    assert torch.equal(a[0], b[0])
    for r in (ref, pipe):
        r.commit(3, {"t": (1, [15])})  # keep the root and the second sibling (moved down)
    _assert_same_kv(ref, pipe, ["t"])
    for r in (ref, pipe):
        r.drop("t")
    assert pipe.kv_length("t") == 0 and pipe.session_kv("t") is None


@pytest.mark.ray
def test_concurrent_batches_in_flight_match_sequential(pipe, tiny6):
    """K threads verify disjoint session groups at once (several batches in the pipeline)."""
    model, vocab = tiny6.model, tiny6.vocab_size
    groups = [[f"c{pipe.pipeline_parallel_size}-{g}-{i}" for i in range(3)] for g in range(3)]
    params_of = lambda sid: SamplingParams(max_tokens=30)  # noqa: E731
    ref = VerifierEngine(model, eos_token_ids=tiny6.eos_token_ids)
    eng = VerifierEngine(model, eos_token_ids=tiny6.eos_token_ids, runner=pipe)
    expected = [_run_sessions([ref], model, vocab, rounds=8, seed=g, sids=grp, params_of=params_of)[0]
                for g, grp in enumerate(groups)]
    got: list = [None] * len(groups)
    errors: list = []
    barrier = threading.Barrier(len(groups))

    def worker(g):
        try:
            barrier.wait()
            got[g] = _run_sessions([eng], model, vocab, rounds=8, seed=g, sids=groups[g], params_of=params_of)[0]
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(e)

    pipe.reset_stats()
    threads = [threading.Thread(target=worker, args=(g,)) for g in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == expected
    _assert_same_kv(ref.runner, pipe, [s for grp in groups for s in grp])
    assert all(s["forwards"] >= 3 * 9 for s in pipe.stage_stats())
    for grp in groups:
        for s in grp:
            eng.close(s)


def _open_and_verify(engine: VerifierEngine) -> list:
    out = engine.open([OpenRequest("b", [4, 5, 6, 7], SamplingParams(max_tokens=8))])
    return out + engine.verify([VerifyRequest("b", DraftTree((9, 10, 11), (-1, -1, 0)), 5)])


@pytest.mark.ray
def test_build_runner_inside_a_replicas_placement_group(ray_session):
    """A stand-in replica in bundle 0 of pipeline_bundles' group builds a 2-stage runner:
    stage i takes bundle i + 1 (its resources), and the engine matches build_runner(pp=1)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from deploy.verifier.pipeline import build_runner

    one = build_runner(TINY, 1)
    assert isinstance(one, ModelRunner) and not isinstance(one.loaded.model, ModelShell)
    want = _open_and_verify(VerifierEngine(one.loaded.model, eos_token_ids=one.loaded.eos_token_ids, runner=one))

    pg = placement_group(pipeline_bundles(2, "cpu", cpus_per_stage=0.5, replica_cpus=0.25), strategy="PACK")
    ray.get(pg.ready(), timeout=60)

    @ray.remote(num_cpus=0.25)
    class Replica:  # what the Serve replica does; Serve places it in bundle 0
        def run(self):
            runner = build_runner(TINY, 2, torch_threads=STAGE_THREADS)
            engine = VerifierEngine(runner.loaded.model, eos_token_ids=runner.loaded.eos_token_ids, runner=runner)
            try:
                return (ray.util.get_current_placement_group().id.hex(), runner.pipeline_parallel_size,
                        isinstance(runner.loaded.model, ModelShell), runner.stage_stats(), _open_and_verify(engine))
            finally:
                runner.shutdown()

    rep = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0)).remote()
    try:
        pg_id, pp, shell, stats, got = ray.get(rep.run.remote(), timeout=180)
    finally:
        ray.kill(rep)
        remove_placement_group(pg)
    assert pg_id == pg.id.hex() and pp == 2 and shell
    assert [s["placement_group_id"] for s in stats] == [pg.id.hex()] * 2
    # each stage took its own 0.5-CPU bundle (two stages would not fit one bundle)
    assert [s["resources"] for s in stats] == [{"CPU": 0.5}] * 2
    assert [s["torch_threads"] for s in stats] == [STAGE_THREADS] * 2
    assert got == want

