"""Every values file under k8s/values/ fits its card: each verifier replica's (or pipeline stage's, or
tensor-parallel rank's)
memory computed from the target's config shapes (benchmarks/model_shapes.json, the checkpoints'
config.json) as deploy/verifier/kv_sizing.py sizes a pool at start: weights of its layers, the
largest forward's activations, the CUDA graphs, the CUDA context; a pool of at least one
max_model_len session and one batch, and of all of kv_budget_tokens where a file sets it."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from benchmarks.full_size import SHAPES
from deploy.config import AppConfig
from specdec.model.checkpoint import CheckpointConfig
from deploy.verifier.kv_sizing import GIB, GRAPH_ROWS, DoesNotFit, KVPlan, MemoryUse, Shape, activation_bytes, plan
from deploy.verifier.layer_split import split_layers
from deploy.verifier.tensor_parallel import rank_memory
from specdec.model.loading import EMBEDDED_ALIASES

VALUES = sorted((Path(__file__).resolve().parents[2] / "k8s" / "values").glob("*.yaml"))
# what torch.cuda.mem_get_info reports as the total of each card (nvidia.com/gpu.product labels)
GPU_MEMORY = {"NVIDIA-H100-80GB-HBM3": int(79.19 * GIB), "NVIDIA-A100-SXM4-80GB": int(79.15 * GIB)}
OTHER = 1 * GIB  # the CUDA context and libraries' workspaces (on a CPU: the process itself)
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _quantity(q: str) -> int:
    n, unit = re.fullmatch(r"([0-9.]+)([KMGT]i)?", str(q)).groups()
    return int(float(n) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}[unit])


def target_shape(model: str) -> dict:
    name = "HuggingFaceTB/SmolLM2-135M-Instruct" if model in EMBEDDED_ALIASES else model
    found = [s["config"] for s in SHAPES.values() if isinstance(s, dict) and s.get("hub_id") == name]
    assert found, f"no shape for {model!r} in benchmarks/model_shapes.json"
    return found[0]


def stage_plans(values: dict) -> list[KVPlan]:
    """The KV plan of each pipeline stage of one verifier replica (one stage: the replica)."""
    cfg = AppConfig(**values["app"])
    t, vc = cfg.target, cfg.verifier
    config = target_shape(t.model)
    shape = Shape.of(config)
    dtype = BYTES[config["torch_dtype"] if t.dtype == "auto" else t.dtype]
    cuda = t.device == "cuda"
    if cuda:
        total = GPU_MEMORY[values["gpuWorkers"]["nodeSelector"]["nvidia.com/gpu.product"]]
    else:
        total = _quantity(values["head"]["resources"]["limits"]["memory"])
    max_len = t.max_model_len or config["max_position_embeddings"]
    logit_rows = vc.max_batch_sessions * (vc.max_tree_nodes + 1)
    tp = vc.tensor_parallel_size
    plans = []
    for first, last in split_layers(CheckpointConfig.from_dict(config), vc.pipeline_parallel_size):
        logits = min(logit_rows, vc.max_batch_tokens) if last == shape.num_layers else 0
        # one tensor-parallel rank's share (the busiest's; tp 1: the stage's own): deploy/verifier/tensor_parallel.py
        weights, act, kv_bytes = rank_memory(shape, tp, vc.max_batch_tokens, logits, dtype, first, last)
        rows = min(GRAPH_ROWS, vc.max_batch_tokens)
        # no CUDA graphs with tp > 1 (they would capture the collectives)
        graphs = activation_bytes(shape, rows, min(logits, rows), dtype) if cuda and tp == 1 else 0
        memory = MemoryUse("cuda" if cuda else "cpu", total, vc.gpu_memory_utilization, weights, act, graphs, OTHER)
        p = plan(memory, kv_bytes, max_len, vc.batch_room_tokens(), vc.kv_budget_tokens)
        if vc.kv_budget_tokens is not None and p.budget_tokens < vc.kv_budget_tokens:
            raise DoesNotFit(f"stage [{first}, {last}): kv_budget_tokens {vc.kv_budget_tokens:,} asked, "
                             f"{p.budget_tokens:,} fit: {p.describe()}")
        plans.append(p)
    return plans


@pytest.mark.parametrize("path", VALUES, ids=[p.stem for p in VALUES])
def test_every_values_file_fits_its_card(path):
    plans = stage_plans(yaml.safe_load(path.read_text()))
    assert plans and all(p.sessions >= 1 for p in plans), [p.describe() for p in plans]


def test_the_gpu_files_are_sized_for_80gb_cards():
    """Qwen3-14B on one 80 GB GPU; Qwen3-32B in two stages on 2 x 80 GB (the issue's sizes)."""
    one = yaml.safe_load((VALUES[0].parent / "gpu-qwen3-14b.yaml").read_text())
    (p,) = stage_plans(one)
    assert p.memory.total == GPU_MEMORY["NVIDIA-H100-80GB-HBM3"] and p.sessions >= 8
    two = yaml.safe_load((VALUES[0].parent / "gpu-qwen3-32b-sharded.yaml").read_text())
    assert len(stage_plans(two)) == 2 == two["gpuWorkers"]["gpusPerPod"]


@pytest.mark.parametrize("change, message", [
    ({"kv_budget_tokens": 1048576}, "kv_budget_tokens 1,048,576 asked"),  # the 160 GiB pool
    ({"gpu_memory_utilization": 0.4}, "the target does not fit"),  # 31.7 GiB: the weights and little else
    ({"max_batch_tokens": 65536, "max_batch_sessions": 1024}, "the target does not fit"),  # 65K rows of logits
])
def test_a_file_that_does_not_fit_fails(change, message):
    values = copy.deepcopy(yaml.safe_load((VALUES[0].parent / "gpu-qwen3-14b.yaml").read_text()))
    values["app"]["verifier"].update(change)
    with pytest.raises(DoesNotFit, match=message):
        stage_plans(values)


def test_the_70b_file_is_four_tensor_parallel_ranks_on_80gb_cards():
    """Llama-3.1-70B (bf16, 131 GiB of weights) over 4 ranks, one 80 GB GPU each: each rank's quarter of the
    weights, KV heads, activations and gathered logits fit 90 % of its card with the whole kv_budget_tokens; the
    same replica at tensor_parallel_size 2 does not (each rank would hold 66 GiB of weights)."""
    values = yaml.safe_load((VALUES[0].parent / "gpu-llama3.1-70b-tp4.yaml").read_text())
    (p,) = stage_plans(values)
    assert values["app"]["verifier"]["tensor_parallel_size"] == 4 == values["gpuWorkers"]["gpusPerPod"]
    assert 32 * GIB < p.memory.weights < 34 * GIB and p.sessions >= 8
    values["app"]["verifier"]["tensor_parallel_size"] = 2
    with pytest.raises(DoesNotFit):
        stage_plans(values)
