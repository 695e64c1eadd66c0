"""KV pool sizing from memory (verifier.gpu_memory_utilization): the arithmetic, the refusal,
and a replica on a tiny model whose pool is what its memory gives."""

from __future__ import annotations

import pytest
import torch

from deploy.config import AppConfig
from deploy.verifier.server import VerifierServer
from deploy.verifier.kv_sizing import (GIB, DoesNotFit, MemoryUse, Shape, activation_bytes, device_memory, plan,
                                       probe_forward, tensor_bytes)
from specdec.model.decoder import DecoderModel
from specdec.model.loading import tiny_random_model
from specdec.model.native import PAGE_SIZE

QWEN3_14B = dict(model_type="qwen3", num_hidden_layers=40, hidden_size=5120, num_attention_heads=40,
                 num_key_value_heads=8, head_dim=128, intermediate_size=17408, vocab_size=151936,
                 tie_word_embeddings=False)
LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)


def test_shapes_give_the_published_sizes():
    q = Shape.of(QWEN3_14B)
    assert q.kv_bytes_per_token(2) == 160 * 1024  # 40 layers x 8 KV heads x 128 x (K, V) x 2 bytes
    assert 14.7e9 < q.weight_bytes(1) < 14.8e9  # Qwen3-14B: 14.8B parameters
    llama = Shape.of(LLAMA3_8B)
    assert llama.head_dim == 128 and llama.kv_bytes_per_token(2) == 128 * 1024
    assert 8.02e9 < llama.weight_bytes(1) < 8.04e9  # Llama-3.1-8B: 8.03B
    # two stages hold every layer once, the embedding in the first and the head in the last
    assert llama.weight_bytes(2, 0, 16) + llama.weight_bytes(2, 16, 32) == llama.weight_bytes(2)
    assert llama.kv_bytes_per_token(2, 16) * 2 == llama.kv_bytes_per_token(2)


def test_activations_count_rows_and_logits():
    s = Shape.of(LLAMA3_8B)
    one = activation_bytes(s, 1, 1, 2)
    assert activation_bytes(s, 10, 1, 2) - one == 9 * (one - s.vocab_size * 6)
    assert activation_bytes(s, 10, 4, 2) - activation_bytes(s, 10, 1, 2) == 3 * s.vocab_size * 6


def _memory(weights_gib: float, total_gib: float = 80, util: float = 0.9) -> MemoryUse:
    return MemoryUse("cuda:0", int(total_gib * GIB), util, int(weights_gib * GIB), 2 * GIB, 1 * GIB, 1 * GIB)


def test_the_pool_gets_what_the_budget_leaves():
    p = plan(_memory(30), 160 * 1024, 40960, 6144, None)
    assert p.capacity_tokens == (72 - 30 - 4) * GIB // (160 * 1024) == 249_036
    assert p.budget_tokens == 249_036 - 6144 and p.sessions == p.budget_tokens // 40960 == 5
    assert not p.capped and p.stats()["memory"]["for_kv"] == 38 * GIB
    assert "249,036 tokens" in p.describe() and "5 of max_model_len 40,960" in p.describe()


def test_kv_budget_tokens_caps_the_pool():
    p = plan(_memory(30), 160 * 1024, 40960, 6144, 100_000)
    assert p.capacity_tokens == 106_144 and p.budget_tokens == 100_000 and p.capped
    assert plan(_memory(30), 160 * 1024, 40960, 6144, 10**7).capacity_tokens == 249_036  # memory wins
    # below one max_model_len session the cap is the operator's choice, not refused
    assert plan(_memory(30), 160 * 1024, 40960, 6144, 256).budget_tokens == 256


def test_a_target_that_cannot_fit_is_refused_with_the_numbers():
    with pytest.raises(DoesNotFit) as e:
        plan(_memory(66), 160 * 1024, 40960, 6144, None)  # leaves 2 GiB = 13,107 tokens
    msg = str(e.value)
    for part in ("max_model_len 40,960", "needs 47,104 KV tokens", "0.90 x 80.00 GiB = 72.00 GiB",
                 "weights take 66.00 GiB", "leaving 2.00 GiB (13,107 tokens)", "gpu_memory_utilization"):
        assert part in msg, msg
    plan(_memory(66), 160 * 1024, 8192, 4096, None)  # a shorter context fits


def test_probe_forward_runs_the_largest_batch():
    m = DecoderModel(tiny_random_model(seed=0, num_layers=2))
    scratch = probe_forward(m, 300, 128, 40)  # three sessions of 128, 128 and 44 rows
    pages = (300 + 64 * 3 + 15) // PAGE_SIZE  # the scratch pool: the rows and room for each session's pages
    assert scratch == pages * PAGE_SIZE * 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, fp32


def _core(**verifier) -> VerifierServer:
    return VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32", "max_model_len": 1024},
                                  verifier={"max_batch_tokens": 64, "max_batch_sessions": 4, **verifier}))


def test_a_replica_sizes_its_pool_from_memory_and_says_so():
    core = _core(kv_budget_tokens=None, gpu_memory_utilization=0.01)
    p = core.kv_plan
    m = p.memory
    assert m.device == "cpu" and m.weights == tensor_bytes(core.loaded.model) and m.graphs == 0
    assert p.kv_bytes_per_token == 2 * 2 * 16 * 2 * 4  # layers x KV heads x head dim x (K, V) x fp32
    assert p.capacity_tokens == m.for_kv // p.kv_bytes_per_token and not p.capped
    assert core.engine.runner.pool.capacity_tokens == -(-p.capacity_tokens // PAGE_SIZE) * PAGE_SIZE
    assert core._limits.kv_budget_tokens == p.budget_tokens == p.capacity_tokens - (64 + 32 * 4)
    stats = core.stats()
    assert stats["kv_pool_tokens"] == p.capacity_tokens and stats["kv_capacity_sessions"] == p.budget_tokens // 1024
    capped = _core(kv_budget_tokens=4096)
    assert capped.kv_plan.capacity_tokens == 4096 + 64 + 32 * 4 and capped.stats()["kv_capped"]


def test_a_replica_that_cannot_fit_is_refused_at_start():
    with pytest.raises(DoesNotFit, match=r"tiny-random\(seed=0\): the target does not fit: one session of "
                                         r"max_model_len 1,024"):
        _core(gpu_memory_utilization=1e-9)


def test_tensor_bytes_counts_a_tied_tensor_once():
    lin = torch.nn.Linear(4, 8, bias=False)
    tied = torch.nn.ModuleDict({"a": lin, "b": torch.nn.Linear(4, 8, bias=False)})
    tied["b"].weight = lin.weight
    assert tensor_bytes(tied) == 32 * 4


def test_a_replica_holds_each_weight_once():
    core = _core(kv_budget_tokens=4096)
    model, fused = core.loaded.model, core.engine.runner.model.layers[1]
    a = model.model.layers[1].self_attn
    qkv = fused.qkv.weight
    assert a.k_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), qkv)
    rope = model.model.rotary_emb.inv_freq
    assert core.kv_plan.memory.weights == Shape.of(model.config).weight_bytes(4) + rope.numel() * 4


def test_a_pipeline_stage_checks_that_the_shared_pool_fits_its_device():
    from deploy.config import ModelConfig, VerifierConfig
    from deploy.verifier.kv_sizing import Sizing
    from deploy.verifier.pipeline_stage import PipelineStage

    target = ModelConfig(model="tiny-random", dtype="float32", tiny_config={"num_layers": 2})
    vc = VerifierConfig(kv_budget_tokens=4096, max_batch_tokens=64, max_batch_sessions=4)
    stage = PipelineStage(target, 1, 2, kv_capacity_tokens=vc.kv_pool_tokens(), sizing=Sizing.of(vc, 1024))
    assert stage.kv_plan.capped and stage.runner.pool.capacity_tokens >= vc.kv_pool_tokens()
    assert stage.kv_plan.kv_bytes_per_token == 2 * 1 * 2 * 16 * 4  # this stage's one layer
    # memory that holds a session but not the cap: refused, naming the stage and both numbers
    kv = stage.kv_plan.kv_bytes_per_token
    m = stage.kv_plan.memory
    util = (m.weights + m.activations + 3000 * kv) / m.total
    tight = VerifierConfig(kv_budget_tokens=4096, max_batch_tokens=64, max_batch_sessions=4,
                           gpu_memory_utilization=util)
    with pytest.raises(DoesNotFit, match=r"layers \[1, 2\): verifier.kv_budget_tokens 4,096 plus one batch needs "
                                         r"4,288 KV tokens, the stage's memory holds (2,99\d|3,000) "):
        PipelineStage(target, 1, 2, kv_capacity_tokens=tight.kv_pool_tokens(), sizing=Sizing.of(tight, 1024))


def test_host_memory_is_the_machine_or_its_cgroup_limit():
    import os

    total = device_memory("cpu")
    assert 0 < total <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
