"""Early exits with pipeline stages (deploy/verifier/pipeline.py, exit_heads.py): the stage whose
slice holds an exit computes that exit's logits of the early trees' rows, the replica walks the
trees with them while later stages compute, and the output stays the target's.

A 2-stage runner over a 6-layer tiny model split [0, 1) + [1, 6) with untrained exits after
layers 1 (stage 0) and 3 (stage 1). The reference is the single-process engine with the same
exit heads: the same early results and the same tokens, which are target-only decoding's.
Stages run one torch thread, and so does the reference (bit-identical hidden states, see
tests/verifier/test_pipeline.py).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from deploy.config import EarlyExitConfig, ModelConfig
from deploy.verifier.early_stream import EarlyStreams
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest, VerifyResult
from specdec.exit_heads import ExitHeads
from specdec.model.loading import load_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from tests.specdec.test_engine import random_prompt, random_tree
from tests.specdec.test_engine_embedded import one_thread  # noqa: F401 (autouse: one torch thread)

# wide enough that the last stage's forward takes long next to the replica's walk of one tree
WIDE = ModelConfig(model="tiny-random", dtype="float32", seed=5,
                   tiny_config={"num_layers": 6, "hidden_size": 256, "intermediate_size": 1024})
EXITS = EarlyExitConfig(enabled=True, heads="untrained", layers=[3, 1])


@pytest.fixture(scope="module")
def wide():
    return load_model(WIDE.model, dtype=WIDE.dtype, seed=WIDE.seed, tiny_config=WIDE.tiny_config)


@pytest.fixture(scope="module")
def pipe(ray_session):
    from deploy.verifier.pipeline import PipelineRunner

    runner = PipelineRunner(WIDE, 2, bounds=[0, 1, 6], cpus_per_stage=0.5, torch_threads=1, early_exit=EXITS)
    yield runner
    runner.shutdown()


def pipeline_engine(pipe, wide) -> tuple[VerifierEngine, EarlyStreams]:
    eng = VerifierEngine(wide.model, eos_token_ids=wide.eos_token_ids, runner=pipe)
    return eng, EarlyStreams.attach(eng, EXITS, pipe.loaded.model)  # the replica's path (deployment.py)


@pytest.mark.ray
def test_each_stage_holds_the_exits_of_its_slice(pipe, wide):
    assert pipe.exit_heads.layers == (1, 3) and pipe._exit_stages == {0: (1,), 1: (3,)}
    assert torch.equal(pipe.exit_heads.ids, torch.arange(wide.model.config.vocab_size))
    eng, es = pipeline_engine(pipe, wide)
    assert eng.exit_heads is pipe.exit_heads and es.info() == {"early_exit_layers": [1, 3]}


@pytest.mark.ray
@pytest.mark.parametrize("seed", range(2))
def test_greedy_with_exits_in_pipeline_stages_equals_target_only_decoding(pipe, wide, seed):
    model = wide.model
    V, eos = model.config.vocab_size, wide.eos_token_ids
    eng, _ = pipeline_engine(pipe, wide)
    ref = VerifierEngine(model, eos_token_ids=eos)
    ref.exit_heads = ExitHeads.init(model, (1, 3), rank=8)
    rng = random.Random(seed)
    specs = {}
    for i in range(3):
        prompt, params = random_prompt(rng, V), SamplingParams(max_tokens=rng.randint(8, 24))
        specs[f"g{seed}-{i}"] = (prompt, params, reference_decode(model, prompt, params, eos))
    out = {}
    for e in (eng, ref):
        res = e.open([OpenRequest(sid, p, prm) for sid, (p, prm, _) in specs.items()])
        out[e] = {sid: [r.first_token] for sid, r in zip(specs, res)}
    early = {eng: [], ref: []}
    while live := [sid for sid in specs if not ref.sessions[sid].finished]:
        reqs = []
        for sid in live:
            s = ref.sessions[sid]
            truth = specs[sid][2][s.num_generated:]
            reqs.append(VerifyRequest(sid, random_tree(rng, truth, V, 24, 6), len(s.prefix), early=True))
        for e in (eng, ref):
            for r in e.verify(reqs, on_early=early[e].extend):
                assert isinstance(r, VerifyResult), r
                out[e][r.sid] += list(r.tokens)
    for sid, (_, _, want) in specs.items():
        assert out[eng][sid] == out[ref][sid] == want, sid
    # the stages' exits give the single-process exits' results: same guesses, same order (layer 1, then 3)
    key = [(r.sid, r.layer, r.accepted, r.token, r.prefix_len) for r in early[ref]]
    assert [(r.sid, r.layer, r.accepted, r.token, r.prefix_len) for r in early[eng]] == key
    assert [r.confidence for r in early[eng]] == pytest.approx([r.confidence for r in early[ref]], abs=1e-6)
    assert {r.layer for r in early[eng]} == {1, 3} and len(key) >= 2 * len(specs)
    for sid in specs:
        eng.close(sid)


@pytest.mark.ray
def test_a_stages_early_frames_arrive_while_later_stages_compute(pipe, wide):
    """Layer 1's results reach the sink before the last stage has finished the forward (its
    busy interval, same clock); layer 3's, computed on the last stage, come after it."""
    V = wide.model.config.vocab_size
    eng, _ = pipeline_engine(pipe, wide)
    rng = random.Random(3)
    sids = [f"t{i}" for i in range(8)]
    eng.open([OpenRequest(sid, random_prompt(rng, V, 20, 40), SamplingParams(max_tokens=16)) for sid in sids])
    # one small tree asks for early results; seven 64-node trees make the last stage's work long
    reqs = [VerifyRequest(sids[0], DraftTree((5, 6), (-1, 0)), len(eng.sessions[sids[0]].prefix), early=True)]
    reqs += [VerifyRequest(sid, random_tree(rng, [], V, 64, 8, min_size=64), len(eng.sessions[sid].prefix))
             for sid in sids[1:]]
    got = []
    eng.verify(reqs, on_early=lambda rs: got.append((time.perf_counter(), rs)))
    (t1, r1), (t3, r3) = got
    assert [(r.sid, r.layer) for r in r1 + r3] == [(sids[0], 1), (sids[0], 3)]
    start, end = pipe.busy_intervals()[1][-1]  # the last stage's forward of this batch
    assert t1 < end < t3
    assert eng.last_early.seconds > 0 and eng.last_early.cpu_seconds > 0
    for sid in sids:
        eng.close(sid)


# -- a real checkpoint's slice (no Ray) --------------------------------------------------
@pytest.mark.slow
def test_a_stage_of_the_embedded_checkpoint_builds_its_exits_and_drops_the_head(embedded):
    """Stage [0, 19) of the embedded target holds the artifact's exits 8, 12, 16 (not 20): built from
    the norm and tied head it loads for them, equal to the whole model's, then the head is gone."""
    from deploy.verifier.pipeline_stage import PipelineStage

    cfg = ModelConfig(model="embedded", dtype="float32", device="cpu")
    stage = PipelineStage(cfg, 0, 19, early_exit=EarlyExitConfig(enabled=True))
    layers, ids = stage.exit_info()
    whole = ExitHeads.load("embedded", embedded.model, (8, 12, 16))
    assert layers == (8, 12, 16) and torch.equal(ids, whole.ids)
    h = torch.randn(3, embedded.model.config.hidden_size)
    for x in layers:
        assert torch.equal(stage.heads.logits(x, h), whole.logits(x, h))
    assert not stage.runner.is_last and stage.runner.model.lm_head is None
    # only the subset rows of the head stay
    assert stage.heads.head.shape == (len(ids), h.shape[1]) and len(ids) < embedded.model.config.vocab_size
    assert PipelineStage(cfg, 19, 30, early_exit=EarlyExitConfig(enabled=True, layers=[8])).heads is None
