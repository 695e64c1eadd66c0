"""The Serve app with verifier.tensor_parallel_size 2 (issue 64): rank 0 in the replica, rank 1 a TPWorker actor in
the replica's STRICT_PACK placement group (gloo on CPU); edge agents over HTTP get the target's greedy output; a
worker actor killed mid-generation takes the group down, the replica starts it again and the edges re-open from
their histories with output identical to the reference (tiny random target, fp32)."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
from pathlib import Path

import pytest
import yaml
from ray import serve
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.transport import HttpTransport
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from tests.edge_agent.helpers import noisy_copy
from tests.serve_apps import delete_app

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 99, 4, 250, 31], [7, 7, 300, 12]]


def test_tp2_app_with_edge_agents_and_a_killed_worker(ray_session):
    data = yaml.safe_load((REPO / "deploy" / "config.yaml").read_text())
    args = data["applications"][0]["args"]
    args["target"] = {"model": "tiny-random", "dtype": "float32"}
    args["verifier"].update(tensor_parallel_size=2, num_cpus=0.5, torch_threads=1)
    (app,) = ServeDeploySchema(**data).applications
    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), copy.deepcopy(app.args))
    serve.run(built, name="tp2", route_prefix="/tp2")
    url = f"http://127.0.0.1:{ray_session['http_port']}/tp2"
    target = tiny_random_model(seed=0)
    long = {"max_tokens": 160, "ignore_eos": True}

    async def generate(prompt, sampling):
        t = HttpTransport(url, api_key="specedge-dev-key", timeout_s=60)
        agent = EdgeAgent(t, ModelDrafter(noisy_copy(target, 0.05)), config=AgentConfig(mode="stop-and-wait"))
        try:
            return await agent.generate(prompt, sampling)
        finally:
            agent.close()
            await t.aclose()

    handle = serve.get_deployment_handle("Verifier", app_name="tp2")

    async def killed_mid_generation():
        before = (await handle.get_stats.remote())["verify_forwards"]
        task = asyncio.ensure_future(generate(PROMPTS[0], long))
        while (await handle.get_stats.remote())["verify_forwards"] < before + 3:
            await asyncio.sleep(0.005)
        (pid,) = (await handle.get_stats.remote())["tensor_parallel"]["worker_pids"]
        os.kill(pid, signal.SIGKILL)  # the TPWorker actor's process
        return await task

    try:
        plain = [asyncio.run(generate(p, {"max_tokens": 24, "ignore_eos": True})) for p in PROMPTS]
        tp = handle.get_stats.remote().result()["tensor_parallel"]
        res = asyncio.run(killed_mid_generation())
        after = asyncio.run(generate(PROMPTS[1], {"max_tokens": 24, "ignore_eos": True}))
        tp_after = handle.get_stats.remote().result()["tensor_parallel"]
    finally:
        delete_app("tp2")
    assert tp["tensor_parallel_size"] == 2 and tp["restarts"] == 0
    for r, p in zip(plain, PROMPTS):
        assert r.token_ids == reference_decode(target, p, SamplingParams(max_tokens=24, ignore_eos=True))
        assert r.stats.reopens == 0
    assert res.token_ids == reference_decode(target, PROMPTS[0], SamplingParams(**long))
    assert res.stats.reopens >= 1  # the kill landed mid-generation: the edge re-opened from its history
    assert tp_after["restarts"] == 1 and tp_after["worker_pids"] != tp["worker_pids"]  # a new rank 1
    assert after.token_ids == plain[1].token_ids and after.stats.reopens == 0


def test_two_stages_of_two_ranks_equal_one_stage_of_two_ranks_bit_for_bit(ray_session):
    """pipeline_parallel_size 2 x tensor_parallel_size 2 (each stage actor rank 0 of its group, a TPWorker actor
    its rank 1): the stages pass the full hidden states, so every logit equals the one-stage 2-rank group's."""
    import functools

    import torch

    from deploy.config import ModelConfig
    from deploy.verifier.pipeline import PipelineRunner
    from specdec.model.batch import chunk_input, tree_input
    from specdec.model.checkpoint import tiny_weights
    from specdec.model.tp_runner import ShardSpec, TPRunner

    cfg = ModelConfig(model="tiny-random", dtype="float32", seed=3, tiny_config={"num_layers": 4})
    pipe = PipelineRunner(cfg, 2, use_placement_group=False, cpus_per_stage=0.5, torch_threads=1,
                          kv_capacity_tokens=4096, tensor_parallel_size=2)
    flat = TPRunner(ShardSpec(functools.partial(tiny_weights, 3, torch.float32, num_layers=4),
                              kv_capacity_tokens=4096), 2)
    try:
        assert [s["first"] for s in pipe.stage_stats()] == [0, 2]
        rounds = [[chunk_input("a", 0, list(range(5, 40))), chunk_input("b", 0, [9, 8, 7, 6])],
                  [tree_input("a", 35, 11, [12, 13, 14], [-1, 0, 0], [1, 2, 2]), chunk_input("b", 4, [3])]]
        keeps = [{"a": (35, []), "b": (4, [])}, {"a": (2, [1]), "b": (1, [])}]
        for bid, (items, keep) in enumerate(zip(rounds, keeps)):
            got, want = pipe.forward(bid, items), flat.forward(bid, items)
            assert all(torch.equal(x, y) for x, y in zip(got, want))
            pipe.commit(bid, keep)
            flat.commit(bid, keep)
    finally:
        pipe.shutdown()
        flat.shutdown()
