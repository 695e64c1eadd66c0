"""The same engine on CUDA (skipped without a GPU): the forward, pool and torch attention run
on the device; fp32 greedy output equals target-only decoding; trees agree with the CPU kernel."""

from __future__ import annotations

import random

import pytest
import torch

from deploy.verifier.engine import OpenRequest, VerifierEngine
from deploy.verifier.models import tiny_random_model
from deploy.verifier.reference import reference_decode
from deploy.verifier.sampling import SamplingParams
from tests.verifier.test_engine import drive, random_prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_greedy_verification_on_cuda_equals_target_only_decoding():
    cpu = tiny_random_model(seed=1)
    gpu = tiny_random_model(seed=1).to("cuda")
    rng = random.Random(0)
    specs = {f"g{i}": (random_prompt(rng, 512, 3, 60), SamplingParams(max_tokens=30, ignore_eos=True))
             for i in range(4)}
    truths = {sid: reference_decode(cpu, p, prm) for sid, (p, prm) in specs.items()}
    eng = VerifierEngine(gpu)
    assert eng.runner.pool.k.device.type == "cuda" and not eng.runner.model.kernel
    res = eng.open([OpenRequest(sid, p, prm) for sid, (p, prm) in specs.items()])
    assert [r.first_token for r in res] == [truths[sid][0] for sid in specs]
    drive(eng, truths, rng, check_rounds=True)
    for sid in specs:
        s = eng.sessions[sid]
        assert s.prefix[s.prompt_len:] == truths[sid]


def test_cuda_bf16_runs_trees_and_releases_the_pool():
    model = tiny_random_model(seed=2, dtype=torch.bfloat16).to("cuda")
    rng = random.Random(1)
    eng = VerifierEngine(model)
    eng.open([OpenRequest(f"b{i}", random_prompt(rng, 512, 3, 40), SamplingParams(max_tokens=12, ignore_eos=True))
              for i in range(3)])
    truths = {sid: [] for sid in eng.sessions}
    drive(eng, truths, rng, check_rounds=False)
    assert all(s.finished for s in eng.sessions.values())
    assert eng.runner.pool.pages_in_use == 0


def test_cuda_lora_versions_mixed_in_one_batch_equal_their_merged_models(tmp_path):
    """Sessions of the base and two LoRA versions in every batch on the device: the row groups
    index the model's tensors with device indices (a CPU index tensor raises there)."""
    pytest.importorskip("peft")
    from tests.verifier.test_lora import ALL, decode_mixed, engine_with, make_adapter, merged

    cpu = tiny_random_model(seed=3)
    paths = {"all": make_adapter(cpu, tmp_path / "all", 1, ALL),
             "qv": make_adapter(cpu, tmp_path / "qv", 2, ["q_proj", "v_proj"], r=8)}
    refs = {None: cpu, **{v: merged(cpu, p) for v, p in paths.items()}}
    rng = random.Random(5)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    sessions = {f"{v}-{i}": (v, random_prompt(rng, 512, 3, 50)) for v in refs for i in range(2)}
    truths = {sid: reference_decode(refs[v], p, params) for sid, (v, p) in sessions.items()}
    eng = engine_with(tiny_random_model(seed=3).to("cuda"), paths)
    forwards = []
    eng.on_forward = forwards.append
    assert decode_mixed(eng, sessions, params, truths, rng) == truths
    assert forwards[0].sessions == len(sessions)  # the versions shared a forward
    assert all(p.A.weight.device.type == "cuda" for ad in eng.adapters.loaded.values()
               for pairs in ad.layers.values() for p in pairs.values())
