"""verifier.tensor_parallel_size (issue 64) without Ray: the checks at config time, the placement group's bundles,
where a replica fits, one rank's memory. The sharded model and group: tests/specdec/model/test_tensor_parallel.py;
the Serve app: tests/verifier/test_tensor_parallel_serve.py."""

from __future__ import annotations

import pytest

from deploy.config import AppConfig
from deploy.verifier.kv_sizing import Shape
from deploy.verifier.tensor_parallel import placement_problem, rank_memory, tp_bundles

TP2 = dict(target={"model": "tiny-random", "dtype": "float32"}, verifier={"tensor_parallel_size": 2})


def test_a_target_that_does_not_split_is_refused_at_config_time():
    with pytest.raises(ValueError, match="9 attention heads / 3 KV heads cannot be split over 4 ranks"):
        AppConfig(target={"model": "embedded"}, verifier={"tensor_parallel_size": 4})
    with pytest.raises(ValueError, match="intermediate size 130 is not divisible by tensor_parallel_size 4"):
        AppConfig(target={"model": "tiny-random", "tiny_config": {"intermediate_size": 130}},
                  verifier={"tensor_parallel_size": 4})
    AppConfig(target={"model": "embedded"}, verifier={"tensor_parallel_size": 2})  # 1 and 2 KV groups per rank


@pytest.mark.parametrize("change, message", [
    ({"topology": "colocated"}, "topology colocated"),
    ({"verifier": {"tensor_parallel_size": 2, "kv_budget_tokens": None}}, "kv_budget_tokens null"),
    ({"verifier": {"tensor_parallel_size": 2, "early_exit": {"enabled": True, "heads": "untrained"}}},
     "verifier.early_exit"),
])
def test_what_tensor_parallelism_does_not_combine_with(change, message):
    with pytest.raises(ValueError, match=message):
        AppConfig(**{**TP2, **change})


def test_lora_versions_combine_with_tensor_parallelism():
    """Versions are sharded as the base (tests/specdec/model/test_tensor_parallel_lora.py); stages still refuse them."""
    tp = AppConfig(**{**TP2, "target": {**TP2["target"], "adapters": {"v1": "/adapters/v1"}}})
    assert tp.target.adapters == {"v1": "/adapters/v1"}
    with pytest.raises(ValueError, match="pipeline_parallel_size 1"):
        AppConfig(**{**TP2, "target": {**TP2["target"], "adapters": {"v1": "/a"}},
                     "verifier": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}})


def test_bundles_one_stage_and_stages():
    # one stage: the replica is rank 0 (its device in bundle 0), ranks 1..3 behind it
    assert tp_bundles(4, 1, "cuda", 4, 1, 2) == [{"CPU": 4.0, "GPU": 1.0}] + [{"CPU": 4.0, "GPU": 1.0}] * 3
    # 2 stages x 2 ranks: the replica on CPU, then stage 0's ranks, then stage 1's
    assert tp_bundles(2, 2, "cpu", 0.5, 0, 0.25) == [{"CPU": 0.25}] + [{"CPU": 0.5}] * 4


def test_options_of_the_verifier_deployment():
    from deploy.application import verifier_options

    cfg = AppConfig(target={"model": "tiny-random", "device": "cuda"},
                    verifier={"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_gpus_per_stage": 1,
                              "num_cpus": 2})
    opts = verifier_options(cfg)
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["placement_group_bundles"] == [{"CPU": 2.0}] + [{"CPU": 2.0, "GPU": 1.0}] * 4
    one = verifier_options(AppConfig(**{**TP2, "verifier": {"tensor_parallel_size": 2, "num_cpus": 0.5}}))
    assert one["ray_actor_options"] == {"num_cpus": 0.5} and len(one["placement_group_bundles"]) == 2


def node(gpus, cpus, alive=True):
    return {"Alive": alive, "Resources": {"GPU": gpus, "CPU": cpus}}


def test_placement_needs_one_node_with_every_device_of_a_replica():
    cfg = AppConfig(target={"model": "tiny-random", "device": "cuda"},
                    verifier={"tensor_parallel_size": 4, "num_gpus_per_stage": 1, "num_cpus": 2})
    assert placement_problem(cfg, [node(4, 16), node(2, 8)]) is None
    msg = placement_problem(cfg, [node(2, 16), node(2, 16), node(8, 16, alive=False)])
    assert "one replica needs 4 GPU(s) and 8 CPU(s) on one node (STRICT_PACK)" in msg and "2 GPU / 16 CPU" in msg
    assert placement_problem(cfg, [node(0, 8)]) is None  # no GPU node yet: an autoscaler adds them
    cpu = AppConfig(**{**TP2, "verifier": {"tensor_parallel_size": 2, "num_cpus": 1}})
    assert placement_problem(cpu, [node(0, 1)]) is not None and placement_problem(cpu, [node(0, 2)]) is None


LLAMA70 = dict(model_type="llama", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
               num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256)


def test_one_ranks_memory_is_its_share():
    s = Shape.of(LLAMA70)
    w1, _, kv1 = rank_memory(s, 1, 4096, 4096, 2)
    w4, a4, kv4 = rank_memory(s, 4, 4096, 4096, 2)
    assert kv4 * 4 == kv1  # 2 of 8 KV heads each
    assert abs(w4 * 4 - w1) / w1 < 1e-3  # norms are whole on every rank: a hair more than a quarter
    assert 32 < w4 / 2**30 < 33.5  # ~131 GiB of bf16 weights over 4
    # 16 ranks: 8 KV heads replicated twice, so a rank's KV is an eighth, not a sixteenth
    assert rank_memory(s, 16, 4096, 4096, 2)[2] * 8 == kv1
