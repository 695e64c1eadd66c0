"""The Serve app with a 2-stage pipeline-parallel verifier, from the config file, end to end
with an edge agent over HTTP (tiny random target, fp32); the proactive runs pre-draft from the
early frames of an exit in stage 0 (issue 19)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import yaml
from ray import serve
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema
from ray._common.utils import import_attr

from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.transport import HttpTransport
from tests.edge_agent.helpers import noisy_copy
from tests.serve_apps import delete_app

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
SAMPLING = {"max_tokens": 24, "ignore_eos": True}


def test_pp2_app_from_config_file_with_edge_agent(ray_session):
    data = yaml.safe_load((REPO / "deploy" / "config.yaml").read_text())
    data["applications"][0]["args"]["target"] = {"model": "tiny-random", "dtype": "float32"}
    data["applications"][0]["args"]["verifier"]["pipeline_parallel_size"] = 2
    data["applications"][0]["args"]["verifier"]["torch_threads"] = 1
    data["applications"][0]["args"]["verifier"]["early_exit"] = {"enabled": True, "heads": "untrained", "layers": [1]}
    (app,) = ServeDeploySchema(**data).applications
    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), copy.deepcopy(app.args))
    serve.run(built, name="pp2", route_prefix="/pp2")
    url = f"http://127.0.0.1:{ray_session['http_port']}/pp2"
    target = tiny_random_model(seed=0)
    prompts = [[5, 17, 99, 4, 250, 31], [7, 7, 300, 12], [42] * 9]

    async def main():
        outs = []
        for mode in ("proactive", "stop-and-wait"):
            for p in prompts:
                t = HttpTransport(url, api_key="specedge-dev-key", timeout_s=60)
                agent = EdgeAgent(t, ModelDrafter(noisy_copy(target, 0.005)),
                                  config=AgentConfig(mode=mode, predraft=mode == "proactive"))
                try:
                    outs.append(await agent.generate(p, SAMPLING))
                finally:
                    agent.close()
                    await t.aclose()
        return outs

    try:
        results = asyncio.run(main())
        stats = serve.get_deployment_handle("Verifier", app_name="pp2").get_stats.remote().result()
    finally:
        delete_app("pp2")
    for res, p in zip(results, prompts * 2):
        assert res.token_ids == reference_decode(target, p, SamplingParams(**SAMPLING))
        assert res.stats.reopens == 0
    assert stats["verify_forwards"] > 0
    for res in results[:len(prompts)]:  # the proactive runs: stage 0's exit, over the WebSocket, each round
        # that asked (one with a tree: how many have one depends on the server's budget hints, i.e. on load)
        assert res.stats.early_frames == res.stats.early_asks > 0
