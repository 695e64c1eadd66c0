"""The two real target versions of the embedded SmolLM2 (deploy/artifacts/versions, made by
benchmarks/train_versions.py) through the edge path: frozen embedded draft, edge agents of
the base and of both versions on one replica, their rounds verified in the same forwards;
fp32 greedy output of each equals that version's own decoding (PEFT merges the adapter into
a plain HF model, ``generate()``), token for token."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch

from deploy.config import AppConfig
from deploy.verifier.server import VerifierServer
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.replica_transport import ReplicaTransport
from tests.specdec.test_engine_embedded import chat_prompt

peft = pytest.importorskip("peft")
VERSIONS = Path(__file__).resolve().parents[2] / "deploy" / "artifacts" / "versions"
TEXTS = ["Continue this Python code:\n```python\ndef dumps(obj, indent=None):\n    \"\"\"Serialize obj.\"\"\"\n```",
         "Write the README of the Python package tinyhttp."]
N = 20


@pytest.fixture(scope="module")
def versions():
    paths = {v: str(VERSIONS / v) for v in ("code", "docs")}
    missing = [p for p in paths.values() if not (Path(p) / "adapter_model.safetensors").exists()]
    if missing:
        pytest.fail(f"target versions missing: {missing}; run `make adapters`")
    return paths


@torch.inference_mode()
def merged_generate(base, path: str | None, prompt: list[int], eos) -> list[int]:
    """The version's own decoding: PEFT merges the adapter into a copy of the HF model; greedy generate()."""
    from peft import PeftModel

    model = base if path is None else PeftModel.from_pretrained(copy.deepcopy(base), path).merge_and_unload()
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=N, do_sample=False, eos_token_id=list(eos), pad_token_id=list(eos)[0])
    return out[0, len(prompt):].tolist()


def test_every_version_through_the_edge_path_equals_its_merged_model(embedded, versions):
    from edge_agent.embedded_draft import load_draft

    prompts = [chat_prompt(embedded.tokenizer, t) for t in TEXTS]
    jobs = [(None, prompts[0]), ("code", prompts[0]), ("docs", prompts[0]), ("docs", prompts[1])]
    truths = [merged_generate(embedded.model, versions.get(v), p, embedded.eos_token_ids) for v, p in jobs]
    assert len({tuple(t) for t in truths[:3]}) == 3  # on one prompt, the three versions really differ
    cfg = AppConfig(target={"model": "embedded", "dtype": "float32", "adapters": versions, "max_loaded_adapters": 2},
                    verifier={"batch_wait_ms": 20.0})
    core = VerifierServer(cfg, loaded=embedded)
    sizes = []  # versions per forward
    activate = core.versions.registry.activate
    core.versions.registry.activate = lambda names: (sizes.append(len(names)), activate(names))[1]
    draft = load_draft(None, "embedded-draft", dtype="float32")
    drafter = [ModelDrafter(draft, vocab_map=draft.vocab_map) for _ in jobs]
    agents = [EdgeAgent(ReplicaTransport(core), d, config=AgentConfig(model=v, budget=16, mode="stop-and-wait"))
              for d, (v, _) in zip(drafter, jobs)]
    params = SamplingParams(max_tokens=N)

    async def run():
        return await asyncio.gather(*[a.generate(p, params) for a, (_, p) in zip(agents, jobs)])

    try:
        results = asyncio.run(run())
    finally:
        for a in agents:
            a.close()
    for (v, _), res, truth in zip(jobs, results, truths):
        assert res.token_ids == truth, v
    assert max(sizes) == 2  # both versions' rounds shared forwards (with the base's)
