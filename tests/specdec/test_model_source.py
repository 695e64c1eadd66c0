"""A model spec's config.json without its weights (local directory, hub cache); stages of a hub-cached
checkpoint read only their layers; ``dtype: auto`` follows the checkpoint's ``torch_dtype``."""

from __future__ import annotations

import pytest
import torch

from benchmarks import full_size
from deploy.config import ModelConfig
from specdec.model_source import checkpoint_dtype, config_json, context_length, hub_dir
from specdec.model.checkpoint import tiny_config
from specdec.model.loading import load_weights, resolve_dtype, safetensors_dir


def write_checkpoint(where, torch_dtype: str | None = None, num_layers: int = 3):
    """A tiny Llama as a safetensors checkpoint directory with the embedded tokenizer's files."""
    cfg = tiny_config(num_layers=num_layers)
    if torch_dtype:
        cfg["torch_dtype"] = torch_dtype
    return full_size.write_checkpoint(cfg, where)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An HF hub cache holding ``acme/tiny`` (one snapshot), as a download would leave it."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    write_checkpoint(repo / "snapshots" / "0123abcd", "float16")
    return repo / "snapshots" / "0123abcd"


def test_config_json_of_a_directory_and_of_the_hub_cache(tmp_path, hub_cache):
    d = write_checkpoint(tmp_path / "local", "bfloat16")
    assert config_json(str(d))["num_hidden_layers"] == 3
    assert hub_dir("acme/tiny") == hub_cache and config_json("acme/tiny")["torch_dtype"] == "float16"
    assert config_json("acme/absent") is None and config_json(str(tmp_path / "nowhere")) is None
    assert config_json("tiny-random") is None and config_json("a/b/c") is None
    assert context_length({"model_type": "qwen3"}) == 32768 and context_length({"max_position_embeddings": 9}) == 9
    assert checkpoint_dtype({"dtype": "float16"}) == "float16" and checkpoint_dtype({}) is None


def test_dtype_auto_follows_the_checkpoint(tmp_path, hub_cache):
    for name, want in [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                       ("float32", torch.bfloat16), (None, torch.bfloat16)]:  # fp32 only when asked
        d = write_checkpoint(tmp_path / str(name), name, num_layers=1)
        assert resolve_dtype("auto", "cpu", str(d)) == want, name
        assert load_weights(str(d), device="cpu").dtype == want
    assert resolve_dtype("auto", "cpu", "acme/tiny") == torch.float16
    assert resolve_dtype("float32", "cpu", "acme/tiny") == torch.float32
    assert resolve_dtype("auto", "cpu", "tiny-random") == torch.bfloat16


def test_stages_of_a_hub_cached_target_read_only_their_layers(hub_cache):
    from deploy.verifier.pipeline_stage import load_stage

    assert safetensors_dir("acme/tiny") == hub_cache
    stage = load_stage(ModelConfig(model="acme/tiny", dtype="float32"), 1, 2)
    names = {n for n, _ in stage.model.named_parameters()}
    assert names and all(n.startswith("model.layers.1.") for n in names), sorted(names)
    whole = load_weights(str(hub_cache), dtype="float32")
    down = stage.model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(down, whole.model.model.layers[1].mlp.down_proj.weight)
