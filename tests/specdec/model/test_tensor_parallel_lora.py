"""LoRA target versions at 2 tensor-parallel ranks (issue 64): each version cut as the base weights it adds to
(specdec.model.lora.shard_factors). Each rank's LoRA output equals the merged model's shard (even, uneven and
replicated KV heads); sessions of the base and of versions in one batch through the 2-rank engine equal 2-rank
one-token decoding (fp32, bf16); 2 ranks against 1 on a version (fp32); wrong shards fail that comparison.
docs/tensor_parallel.md."""

from __future__ import annotations

import dataclasses
import functools
import os
import random

import pytest
import torch

from deploy.verifier.adapters import AdapterRegistry
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
from specdec.model import lora
from specdec.model.batch import chunk_input
from specdec.model.checkpoint import tiny_weights
from specdec.model.loading import tiny_random_model
from specdec.model.runner import ModelRunner
from specdec.model.tensor_parallel import FixedOrderGroup, TPDecoderModel
from specdec.model.tp_runner import ShardSpec, TPRunner
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from tests.specdec.model.test_lora import ALL, LIMITS, decode_among_others, make_adapter, merged, one_token
from tests.specdec.test_engine import random_prompt, random_tree

peft = pytest.importorskip("peft")
UNEVEN = dict(num_heads=6, num_kv_heads=3, hidden_size=96)  # the ranks hold 1 and 2 KV groups (3 and 6 heads)
SHARED_KV = dict(num_heads=4, num_kv_heads=1)  # one KV head, replicated on both ranks
MLP = ["gate_proj", "up_proj", "down_proj"]
CONFIGS = {"fp32": (torch.float32, {}), "bf16-uneven": (torch.bfloat16, UNEVEN)}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Per config: the fp32 HF base (seed 0) and two versions: every linear (r=4), the MLP only (r=2)."""
    d = tmp_path_factory.mktemp("tp-lora")
    out = {}
    for name, (_, cfg) in CONFIGS.items():
        base = tiny_random_model(seed=0, **cfg)
        out[name] = base, {"all": make_adapter(base, d / name / "all", 11, ALL),
                           "mlp": make_adapter(base, d / name / "mlp", 12, MLP, r=2)}
    return out


@pytest.fixture(scope="module")
def groups():
    made: dict[str, TPRunner] = {}

    def get(name: str) -> TPRunner:
        if name not in made:
            dtype, cfg = CONFIGS[name]
            made[name] = TPRunner(ShardSpec(functools.partial(tiny_weights, 0, dtype, **cfg),
                                            kv_capacity_tokens=1 << 15), 2)
        return made[name]

    yield get
    for r in made.values():
        r.shutdown()


def engine_on(model, runner, paths, max_loaded: int = 4) -> VerifierEngine:
    """An engine on ``runner`` with ``paths``'s versions, the registry wired as deploy/verifier/versions.py does."""
    eng = VerifierEngine(model, runner=runner, limits=LIMITS)  # runner None: 1 rank
    eng.adapters = AdapterRegistry(eng.runner.model, paths, max_loaded, getattr(runner, "sync_adapters", None))
    return eng


# -- each rank's shard ----------------------------------------------------------------------
@pytest.mark.parametrize("cfg,tp", [({}, 2), (UNEVEN, 2), (SHARED_KV, 2),
                                    (dict(num_heads=8, num_kv_heads=2), 4)])
def test_each_ranks_lora_output_equals_the_merged_models_shard(tmp_path, cfg, tp):
    """Per rank and layer: the base shard's fused linears plus its LoRA shard equal the PEFT-merged model's shard
    (the base's shard plan) on the same input: output rows of QKV and gate/up (A whole), partial sums of o and
    down (A's columns of the rank's input slice); fp32, within rounding. The deltas are not negligible."""
    base = tiny_random_model(seed=0, **cfg)
    path = make_adapter(base, tmp_path / "all", 5, ALL)
    full = merged(base, path)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, base.config.hidden_size, generator=g)  # [N, D]
    for rank in range(tp):
        mine = TPDecoderModel(base, FixedOrderGroup(None, None, rank, tp))
        ref = TPDecoderModel(full, FixedOrderGroup(None, None, rank, tp))
        groups = [(mine.load_adapter("all", path), None)]
        for i, (w, m) in enumerate(zip(mine.layers, ref.layers)):
            for name in ("qkv", "o", "gate_up", "down"):
                f, want = getattr(w, name), getattr(m, name)
                f, want = getattr(f, "local", f), getattr(want, "local", want)
                xin = x if name in ("qkv", "gate_up") else torch.randn(7, f.weight.shape[1], generator=g)
                got = lora.add_lora(f(xin), xin, groups, i, name)
                exp = want(xin)
                assert float((got - exp).abs().max()) < 1e-4, (rank, i, name)
                assert float((f(xin) - exp).abs().max()) > 1e-2, (rank, i, name)  # the delta is there


# -- batch invariance at 2 ranks ---------------------------------------------------------------
@pytest.mark.parametrize("name,seed", [("fp32", 0), ("bf16-uneven", 1)])
def test_versions_in_one_batch_equal_two_rank_one_token_decoding(versions, groups, name, seed):
    """Sessions of the base and two versions, random trees around each one's own truth, random other sessions
    (base and versions) in every batch, one version held at a time (loads and evictions on every rank): each
    session's greedy output equals its 2-rank one-token decoding, token for token."""
    base, paths = versions[name]
    runner = groups(name)
    model = tiny_random_model(seed=0, dtype=runner.dtype, **CONFIGS[name][1])
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    sessions = {f"{v}-{i}": (v, random_prompt(rng, 512, 1, 60)) for v in (None, "all", "mlp") for i in range(2)}
    truths = {sid: one_token(engine_on(model, runner, paths), p, params, v) for sid, (v, p) in sessions.items()}
    assert len({tuple(t) for t in truths.values()}) == len(truths)
    eng = engine_on(model, runner, paths, max_loaded=1)
    others = {f"o{i}": (rng.choice([None, "all", "mlp"]), random_prompt(rng, 512, 1, 100)) for i in range(5)}
    assert decode_among_others(eng, sessions, others, params, truths, rng, max_size=24) == truths
    assert eng.adapters.evictions > 0
    for sid in list(eng.sessions):
        eng.close(sid)


# -- 2 ranks against 1, fp32 --------------------------------------------------------------------
def two_against_one(runner: TPRunner, base, path: str, rounds: int = 3) -> float:
    """The largest |logit difference| of the version's prefill logits (3 random prompts) at 2 ranks vs 1."""
    rng = random.Random(5)
    one = ModelRunner(base, kv_capacity_tokens=4096)
    one.model.adapters = {"v": one.model.load_adapter("v", path)}
    reg = AdapterRegistry(runner.model, {"v": path}, 1, runner.sync_adapters)
    assert reg.activate({"v"}) == {}
    worst = 0.0
    for bid in range(rounds):
        p = random_prompt(rng, 512, 5, 60)
        item = dataclasses.replace(chunk_input("x", 0, p, list(range(len(p)))), adapter="v")
        a, b = one.forward(bid, [item])[0], runner.forward(bid, [item])[0]
        one.abort(bid)
        runner.abort(bid)
        worst = max(worst, float((a - b).abs().max()))
    return worst


def test_two_ranks_against_one_on_a_version_fp32(versions, groups):
    """Greedy output of a version (all linears) at 2 ranks equals 1 rank's, token for token, and the logits
    agree within float32 rounding: the 2-rank sums add the ranks' partial outputs (base and delta each) in
    another order than 1 rank's one dot product, so they differ in the last bits only."""
    base, paths = versions["fp32"]
    runner = groups("fp32")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    rng = random.Random(3)
    for i in range(3):
        p = random_prompt(rng, 512, 1, 60)
        a = one_token(engine_on(base, None, paths), p, params, "all")
        b = one_token(engine_on(base, runner, paths), p, params, "all")
        assert a == b, (i, a, b)
    worst = two_against_one(runner, base, paths["all"])
    print(f"2 ranks vs 1 on a LoRA version, fp32: max |logit difference| {worst:.2e}")
    assert worst < 1e-4


# -- wrong shards fail ----------------------------------------------------------------------------
def cut_a_for_columns(mats, out, slicer):
    """Wrong: column-parallel linears cut on the LoRA side as row-parallel ones (A's columns of the rank's even
    slice of the input kept, the others zeroed), with no reduction to add the other rank's part."""
    local = RIGHT(mats, out, slicer)
    _, i0, i1 = slicer("gate_proj.weight")
    rank = i0 // (i1 - i0)
    for (_, mod), f in mats.items():
        rule = slicer(f"{mod}.weight")
        if rule is not None and rule[0] == 0:
            K = f["A"].shape[1]
            keep = torch.zeros(K)
            keep[rank * K // 2:(rank + 1) * K // 2] = 1.0
            f["A"] = f["A"] * keep  # [r, K]
    return local


def other_ranks_slice(mats, out, slicer):
    """Wrong: every factor cut with the other rank's slice (an off-by-one rank; 2 ranks, an even split)."""
    def theirs(name: str):
        dim, a, b = slicer(name)
        return (dim, b, 2 * b) if a == 0 else (dim, 0, b - a)

    return RIGHT(mats, out, theirs)


RIGHT = lora.shard_factors
WRONG = {"A cut for column linears": cut_a_for_columns, "the other rank's slice": other_ranks_slice}


def _load_wrong(pid: int, wrong: str):
    """A worker's weights, with ``wrong`` sharding patched in (the test process patches its own rank 0)."""
    if os.getpid() != pid:
        lora.shard_factors = WRONG[wrong]
    return tiny_weights(0, torch.float32)


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_a_wrong_lora_shard_fails_the_comparison(versions, monkeypatch, wrong):
    """Test of the test: with the factors cut wrongly on both ranks, 2 ranks disagree with 1 on the version."""
    base, paths = versions["fp32"]
    monkeypatch.setattr(lora, "shard_factors", WRONG[wrong])
    runner = TPRunner(ShardSpec(functools.partial(_load_wrong, os.getpid(), wrong), kv_capacity_tokens=4096), 2)
    try:
        worst = two_against_one(runner, base, paths["all"])
    finally:
        runner.shutdown()
    print(f"{wrong}: max |logit difference| {worst:.2e}")
    assert worst > 1e-2


# -- a worker that cannot load a version; a worker lost -------------------------------------------
def _load_refusing_mlp(pid: int):
    """A worker's weights; its ``load_adapter`` fails for version ``mlp`` (the test process is rank 0: unchanged)."""
    if os.getpid() != pid:
        right = TPDecoderModel.load_adapter

        def load_adapter(self, name, path):
            if name == "mlp":
                raise OSError(f"{path}: permission denied")
            return right(self, name, path)

        TPDecoderModel.load_adapter = load_adapter
    return tiny_weights(0, torch.float32)


def test_a_version_a_worker_cannot_load_is_unavailable_and_the_others_serve(versions):
    """Rank 1 cannot read version ``mlp``: its sessions get 503 naming rank 1's reason, the version is unavailable
    from then on; a session of ``all`` opened in the same call decodes as at 1 rank."""
    from specdec.errors import VersionUnavailable

    base, paths = versions["fp32"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    truth = one_token(engine_on(base, None, paths), [5, 6, 7, 8], params, "all")
    runner = TPRunner(ShardSpec(functools.partial(_load_refusing_mlp, os.getpid()), kv_capacity_tokens=4096), 2)
    try:
        eng = engine_on(base, runner, paths)
        a, m = eng.open([OpenRequest("a", [5, 6, 7, 8], params, adapter="all"),
                         OpenRequest("m", [5, 6, 7, 8], params, adapter="mlp")])
        assert isinstance(m, VersionUnavailable) and m.status == 503, m
        assert "rank 1: OSError" in m.message and "permission denied" in m.message
        assert "mlp" in eng.adapters.unavailable and eng.adapters.held() == ["all"]
        out, s = [a.first_token], eng.sessions["a"]
        while not s.finished:
            (res,) = eng.verify([VerifyRequest("a", DraftTree.empty(), len(s.prefix))])
            out += list(res.tokens)
        assert out == truth
    finally:
        runner.shutdown()


def test_a_killed_worker_holds_the_versions_again_after_the_restart(versions, groups):
    """The worker is SIGKILLed mid-generation of a version's session: KVStateLost, the group restarts with no
    version held; the session, re-opened from its history, gets the version on every rank again and finishes
    with the undisturbed run's tokens."""
    import signal

    from specdec.errors import KVStateLost

    base, paths = versions["fp32"]
    runner = groups("fp32")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = random_prompt(random.Random(8), 512, 5, 40)
    truth = one_token(engine_on(base, runner, paths), prompt, params, "all")
    eng = engine_on(base, runner, paths)
    (first,) = eng.open([OpenRequest("s", prompt, params, adapter="all")])
    out, restarts, rng = [first.first_token], runner.restarts, random.Random(9)
    while len(out) < 30:
        if len(out) >= 8 and runner.restarts == restarts:
            os.kill(runner.launcher.pids()[0], signal.SIGKILL)
        s = eng.sessions["s"]
        try:
            (res,) = eng.verify([VerifyRequest("s", random_tree(rng, truth[len(out):], 512, max_size=8, max_depth=4),
                                               len(s.prefix))])
        except KVStateLost:
            assert runner._adapters == {}  # the new worker holds nothing yet
            (re,) = eng.open([OpenRequest("s", prompt + out, SamplingParams(max_tokens=30 - len(out),
                                                                              ignore_eos=True), adapter="all")])
            out.append(re.first_token)
            continue
        out += list(res.tokens)
    assert runner.restarts == restarts + 1 and set(runner._adapters) == {"all"}
    assert out == truth
    eng.close("s")
