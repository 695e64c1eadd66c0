"""Chain rounds (issue 17's rejection rule) on a replica (the VerifierServer batch loop, no Serve):
what the replica counts. A rejected round emits no bonus; the residual sample the edge draws
arrives with the next request and is emitted there, so it must count there too (the pacer's
acceptance and ``tokens_emitted``, which the benchmark's whole-server figures divide by)."""

from __future__ import annotations

import asyncio

from deploy.config import AppConfig
from deploy.verifier.server import VerifierServer
from specdec.model.loading import load_model
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.replica_transport import ReplicaTransport
from tests.edge_agent.helpers import noisy_copy


def test_tokens_emitted_counts_the_residual_samples_of_rejected_rounds():
    loaded = load_model("tiny-random", dtype="float32", seed=0)
    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"batch_wait_ms": 1.0}), loaded=loaded)
    agent = EdgeAgent(ReplicaTransport(core), ModelDrafter(noisy_copy(loaded.model, scale=0.5)),
                      config=AgentConfig(verify="rejection", mode="stop-and-wait", depth_policy="fixed", depth=3))
    try:
        res = asyncio.run(agent.generate([1, 5, 9, 33, 7], SamplingParams(max_tokens=40, temperature=1.0,
                                                                          seed=3, ignore_eos=True)))
    finally:
        agent.close()
    assert res.stats.rejections > 3  # rounds whose token came from the edge's residual sample
    assert core.stats()["tokens_emitted"] == len(res.token_ids) == 40
