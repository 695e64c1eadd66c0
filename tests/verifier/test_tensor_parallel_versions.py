"""LoRA target versions on a replica with verifier.tensor_parallel_size 2 (issue 64), without Ray: the
VerifierServer on a 2-rank TPRunner (this process rank 0, one spawned worker), as VerifierDeployment builds it.
Edge agents of the base and two versions get each version's own (PEFT-merged) greedy output; config updates
removing and adding versions reach the worker (it holds what rank 0 holds). Ray's placement: the TP serve test."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from deploy.config import AppConfig
from deploy.verifier.server import VerifierServer
from specdec.model.checkpoint import tiny_weights
from specdec.model.loading import load_model
from specdec.model.tp_runner import ShardSpec, TPRunner
from specdec.reference import reference_decode
from tests.edge_agent.helpers import noisy_copy
from tests.specdec.model.test_lora import ALL, make_adapter, merged
from tests.verifier.test_versions import GREEDY, PROMPTS, run_agents

pytest.importorskip("peft")


def test_versions_at_two_ranks_decode_exactly_and_config_updates_reach_the_worker(tmp_path):
    loaded = load_model("tiny-random", dtype="float32", seed=0)
    paths = {"code": make_adapter(loaded.model, tmp_path / "code", 11, ALL),
             "chat": make_adapter(loaded.model, tmp_path / "chat", 12, ["q_proj", "v_proj", "down_proj"], r=8)}
    refs = {None: loaded.model, **{v: merged(loaded.model, p) for v, p in paths.items()}}
    cfg = AppConfig(target={"model": "tiny-random", "dtype": "float32", "adapters": paths, "max_loaded_adapters": 1},
                    verifier={"batch_wait_ms": 5.0, "max_tree_nodes": 32, "tensor_parallel_size": 2})
    runner = TPRunner(ShardSpec(functools.partial(tiny_weights, 0, torch.float32), kv_capacity_tokens=1 << 14), 2)
    try:
        core = VerifierServer(cfg, runner=runner, loaded=loaded)
        assert core.versions.registry.sync == runner.sync_adapters
        jobs = [(v, p) for v in (None, "code", "chat") for p in PROMPTS[:2]]
        results = asyncio.run(run_agents(core, jobs, noisy_copy(loaded.model, scale=0.01)))
        for (v, p), res in zip(jobs, results):
            assert res.token_ids == reference_decode(refs[v], p, GREEDY), v
        assert len({tuple(r.token_ids) for r in results}) == len(results)
        core._executor.submit(lambda: None).result()  # a forward still in the replica's thread ends first
        assert set(runner._adapters) == set(core.versions.registry.held())  # what the worker holds

        async def updates():
            await core.update_versions({"chat": paths["chat"]}, 1)  # "code" removed
            assert set(runner._adapters) <= {"chat"}
            await core.update_versions({}, 1)  # all removed: the worker holds none
            assert runner._adapters == {}
            await core.update_versions(paths, 2)  # back
            return await run_agents(core, [("code", PROMPTS[2]), ("chat", PROMPTS[2])], loaded.model)

        back = asyncio.run(updates())
        for v, res in zip(("code", "chat"), back):
            assert res.token_ids == reference_decode(refs[v], PROMPTS[2], GREEDY), v
        assert set(runner._adapters) == {"code", "chat"}
    finally:
        runner.shutdown()
