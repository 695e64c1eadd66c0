"""specdec.model.checkpoint: the target's weights without transformers equal the model transformers
builds from the same directory (every tensor, the RoPE buffers, the verifier's logits), per family
and RoPE type; a family's defaults where config.json is silent; refusals; stage slices; and the
replica's load path never imports transformers' modeling code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specdec.errors import UnsupportedModel
from specdec.model.batch import chunk_input
from specdec.model.checkpoint import CheckpointConfig, read_weights, rope_frequencies, tiny_weights
from specdec.model.decoder import DecoderModel, DecoderSpec
from specdec.model.loading import tiny_random_model
from specdec.model.runner import ModelRunner
from tests.specdec.model.test_decoder import SMALL, _build

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
FAMILIES = [
    ("Llama", {}),
    ("Llama", {"rope_scaling": LLAMA3}),
    ("Llama", {"rope_scaling": YARN}),
    ("Llama", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
                                "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}}),
    ("Llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("Llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("Mistral", {"sliding_window": None}),
    ("Qwen2", {}),
    ("Qwen3", {"head_dim": 32}),
]


def _saved(tmp_path, family: str, **over):
    model = _build(family, **over)
    model.save_pretrained(tmp_path)
    return model


def _logits(model, ids: list[int]) -> torch.Tensor:
    r = ModelRunner(DecoderModel(model))
    return r.forward(0, [chunk_input("s", 0, ids, list(range(len(ids))))])[0]


@pytest.mark.parametrize("family, over", FAMILIES)
def test_weights_rope_and_logits_equal_the_transformers_model(tmp_path, family, over):
    hf = _saved(tmp_path, family, **over)
    got = read_weights(tmp_path, torch.float32)
    want = hf.state_dict()
    have = got.state_dict()
    assert set(have) == set(want)
    assert all(torch.equal(have[k], want[k]) for k in want)
    assert torch.equal(got.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert got.model.rotary_emb.attention_scaling == hf.model.rotary_emb.attention_scaling
    assert DecoderSpec.from_config(got.config) == DecoderSpec.from_config(hf.config)
    assert got.config.max_position_embeddings == hf.config.max_position_embeddings
    ids = torch.randint(0, SMALL["vocab_size"], (200,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(_logits(got, ids), _logits(hf, ids))  # positions past the pretraining context too


@pytest.mark.parametrize("raw", [
    {"model_type": "llama"},
    {"model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},  # 4.x
    {"model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192}},
    {"model_type": "llama", "rope_scaling": YARN, "original_max_position_embeddings": 64},
    {"model_type": "mistral", "num_key_value_heads": 2},
    {"model_type": "qwen2"},
    {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1},
    {"model_type": "qwen3"},
])
def test_config_json_reads_as_transformers_reads_it(tmp_path, raw):
    """A config.json that leaves fields out gets transformers' defaults for its family; RoPE
    parameters in 4.x form (rope_theta + rope_scaling) give the frequencies transformers 5's model
    computes (a top-level original_max_position_embeddings wins there, as here)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {k: SMALL[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads")}
    (tmp_path / "config.json").write_text(json.dumps({**shape, **raw}))
    ours, theirs = CheckpointConfig.read(tmp_path), AutoConfig.from_pretrained(tmp_path)
    for key in ("num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "sliding_window", "layer_types", "hidden_act", "eos_token_id"):
        assert getattr(ours, key, None) == getattr(theirs, key, None), key
    assert _spec_or_refusal(ours) == _spec_or_refusal(theirs)
    rotary = AutoModelForCausalLM.from_config(theirs).model.rotary_emb
    inv_freq, scaling = rope_frequencies(ours)
    assert torch.equal(inv_freq, rotary.inv_freq) and scaling == rotary.attention_scaling


def _spec_or_refusal(config):
    try:
        return DecoderSpec.from_config(config)
    except UnsupportedModel as e:
        return str(e)


def test_other_architectures_and_incomplete_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(UnsupportedModel, match="model type 'gpt2' is not supported"):
        read_weights(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(UnsupportedModel, match="lacks vocab_size"):
        read_weights(tmp_path, torch.float32)
    _saved(tmp_path, "Llama")
    from safetensors.torch import load_file, save_file

    f = tmp_path / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if "layers.1.mlp" not in k}, f, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match=r"lacks tensors .*layers\.1\.mlp"):
        read_weights(tmp_path, torch.float32)
    assert read_weights(tmp_path, torch.float32, first=0, last=1) is not None  # a stage without layer 1 loads


def test_a_default_mistral_window_is_refused_by_the_forward(tmp_path):
    _saved(tmp_path, "Mistral")  # transformers' default: a 4096-token sliding window
    with pytest.raises(UnsupportedModel, match="sliding window"):
        DecoderModel(read_weights(tmp_path, torch.float32))


@pytest.mark.parametrize("first, last, keep_head", [(0, 1, False), (1, 2, False), (0, 1, True)])
def test_a_stage_reads_only_its_slice(tmp_path, first, last, keep_head):
    hf = _saved(tmp_path, "Llama", tie_word_embeddings=True)
    got = read_weights(tmp_path, torch.bfloat16, first=first, last=last, keep_head=keep_head)
    names = set(got.state_dict())
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {str(i) for i in range(first, last)}
    assert ("model.embed_tokens.weight" in names) == (first == 0)
    assert ("lm_head.weight" in names) == (last == 2 or keep_head)
    for n in names:
        assert torch.equal(got.state_dict()[n], hf.state_dict()[n].bfloat16()), n


def test_tiny_weights_are_the_tiny_transformers_model():
    import transformers
    from transformers import LlamaForCausalLM

    from specdec.model.loading import tiny_llama_config

    for seed in (0, 3):
        ours, theirs = tiny_weights(seed).state_dict(), tiny_random_model(seed).state_dict()
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
        if int(transformers.__version__.split(".")[0]) >= 5:  # the draws of transformers 5's own init
            torch.manual_seed(seed)
            native = LlamaForCausalLM(tiny_llama_config()).state_dict()
            assert all(torch.equal(ours[k], native[k]) for k in ours)
    a, b = tiny_weights(0, vocab_size=64), tiny_weights(1, vocab_size=64)
    assert a.lm_head.weight.shape == (64, 64) and not torch.equal(a.lm_head.weight, b.lm_head.weight)


@pytest.mark.slow
def test_the_replica_load_path_imports_no_transformers_modeling():
    """What a verifier replica and a pipeline stage load (tiny-random; the embedded model, whose
    tokenizer still comes from transformers' tokenization code) never imports a modeling module."""
    code = ("import sys; from specdec.model.loading import load_weights; from deploy.verifier.pipeline_stage import "
            "load_stage, target_config; from deploy.config import ModelConfig\n"
            "load_weights('tiny-random'); assert not [m for m in sys.modules if m.startswith('transformers')]\n"
            "m = load_weights('embedded', dtype='bfloat16'); load_stage(ModelConfig(model='embedded'), 3, 9)\n"
            "target_config(ModelConfig(model='embedded')); assert m.tokenizer is not None\n"
            "bad = [m for m in sys.modules if m == 'transformers.modeling_utils' or '.modeling_llama' in m]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
