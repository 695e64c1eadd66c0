"""The verifier's own forward: HF parity for each supported family (fp32), clear refusal of
what it does not implement, and the row invariance of the CPU linear layers it relies on."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import UnsupportedModel
from specdec.model.batch import chunk_input, tree_input
from specdec.model.decoder import DecoderModel, DecoderSpec
from specdec.model.linear import Linear
from specdec.model.runner import ModelRunner

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def _build(cls_name: str, **over):
    import transformers

    cfg = getattr(transformers, f"{cls_name}Config")(**{**SMALL, **over})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls_name}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # random, non-trivial biases and norms
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model


@pytest.mark.parametrize("family, over", [
    ("Llama", {}),
    ("Llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("Llama", {"attention_bias": True, "mlp_bias": True}),
    ("Mistral", {"sliding_window": None}),
    ("Qwen2", {}),
    ("Qwen3", {"head_dim": 32}),
])
def test_forward_matches_hf_for_each_supported_family(family, over):
    model = _build(family, **over)
    r = ModelRunner(model)
    ids = torch.randint(0, 256, (30,)).tolist()
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0]  # [30, V]
    got = r.forward(0, [chunk_input("s", 0, ids[:27], list(range(27)))])[0]
    assert (got - want[:27]).abs().max() < 1e-4
    r.commit(0, {"s": (27, [])})
    # a tree whose first branch is the true continuation: rows match the full forward there
    got = r.forward(1, [tree_input("s", 27, ids[27], [ids[28], 7, ids[29]], [-1, -1, 0], [1, 1, 2])])[0]
    assert (got[[0, 1, 3]] - want[[27, 28, 29]]).abs().max() < 1e-4


@pytest.mark.parametrize("family, over, match", [
    ("Mistral", {"sliding_window": 16}, "sliding window"),
    ("Qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, "sliding window"),
    ("Llama", {"hidden_act": "gelu"}, "activation"),
    ("Llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling"),
])
def test_unsupported_configs_are_refused_at_load(family, over, match):
    model = _build(family, **over)
    with pytest.raises(UnsupportedModel, match=match):
        DecoderModel(model)


def test_other_architectures_are_refused():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModel, match="model type 'gpt2' is not supported"):
        DecoderSpec.from_config(GPT2Config())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, k", [(384, 576), (576, 1536)])
def test_bf16_linear_rows_do_not_depend_on_the_row_count(threads, n, k):
    """Batch invariance rests on this: every row of :func:`linear` is the same whatever the
    row count, single rows included (a CPU where it fails shows up here)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(600, k, generator=g).bfloat16()
        lin = Linear(w)
        full = lin(x)
        for m in (2, 3, 7, 16, 33, 144, 512):
            assert torch.equal(lin(x[5: 5 + m]), full[5: 5 + m]), m
        for r in range(0, 600, 5):
            assert torch.equal(lin(x[r: r + 1].clone())[0], full[r]), r
    finally:
        torch.set_num_threads(old)


def _native_linear_here() -> bool:
    from specdec.model.linear import _native_linear

    return _native_linear(torch.zeros(64, 64, dtype=torch.bfloat16)) is not None


needs_native_linear = pytest.mark.skipif(not _native_linear_here(),
                                         reason="no native bf16 linear here (AVX512-BF16 or AVX2 + FMA)")


@needs_native_linear
@pytest.mark.parametrize("n, k, bias", [(961, 576, True), (40, 64, False), (576, 1536, True)])
def test_native_bf16_linear_is_exact_to_one_rounding(n, k, bias):
    """The native kernel (AVX512-BF16 or AVX2 + FMA CPUs) is chosen for bf16 weights and gives the
    float32 product rounded once to bf16: within half a bf16 step of x W^T + b computed in float64."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(9, k, generator=g).bfloat16()
    lin = Linear(w, b)
    assert lin.lib is not None and lin.packed is None
    y = lin(x)
    assert y.shape == (9, n) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    big = torch.maximum(ref.abs(), y.double().abs()).clamp_min(1e-30)
    step = torch.exp2(torch.floor(torch.log2(big)) - 7)  # one bf16 step at the larger of the two
    f32_sum_err = (x.double().abs() @ w.double().abs().T) * k * 2.0 ** -24
    assert ((y.double() - ref).abs() <= step * 0.5 + f32_sum_err).all()


def test_odd_inner_dimension_keeps_the_onednn_path():
    w = torch.randn(32, 33).bfloat16()
    lin = Linear(w)
    assert lin.lib is None
    x = torch.randn(3, 33).bfloat16()
    assert torch.equal(lin(x[:1].clone())[0], lin(x)[0])


def test_head_layouts_the_kernel_does_not_handle_use_the_torch_attention():
    """16 query heads per KV head is beyond the C kernel: the forward still runs (torch path)."""
    model = _build("Llama", hidden_size=128, num_attention_heads=16, num_key_value_heads=1)
    dm = DecoderModel(model)
    assert not dm.kernel
    r = ModelRunner(dm)
    ids = torch.randint(0, 256, (12,)).tolist()
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0]
    assert (r.forward(0, [chunk_input("s", 0, ids, list(range(12)))])[0] - want).abs().max() < 1e-4
