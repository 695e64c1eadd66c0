"""Real model shapes with random weights made on the device (no checkpoint download): what a GPU
benchmark needs to do a real-size model's work per round (``benchmarks/verify_step.py --shape``)."""

from __future__ import annotations

import torch

# config.json fields of the published checkpoints (their shapes only)
SHAPES = {
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                      rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen3-14b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128, intermediate_size=17408,
                      rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                      tie_word_embeddings=False),
}


def random_model(shape: str | dict, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
    """A transformers causal LM of ``shape`` (a name of :data:`SHAPES`, or config fields), its
    weights drawn on ``device`` (N(0, 0.02), norms 1): an 8B model in about a second on a GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
