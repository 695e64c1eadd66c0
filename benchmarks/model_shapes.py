"""Real model shapes with random weights made on the device (no checkpoint download): what a GPU
benchmark needs to do a real-size model's work per round (``benchmarks/verify_step.py --shape``).
The shapes are ``benchmarks/model_shapes.json`` (the checkpoints' config.json fields), shared with
``benchmarks/full_size.py`` and the Helm values' memory test."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CATALOGUE = json.loads(Path(__file__).with_name("model_shapes.json").read_text())  # name -> hub_id, draft, config
SHAPES = {name: entry["config"] for name, entry in CATALOGUE.items() if not name.startswith("_")}


def random_model(shape: str | dict, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
    """A transformers causal LM of ``shape`` (a name of :data:`SHAPES`, or config fields), its
    weights drawn on ``device`` (N(0, 0.02), norms 1): an 8B model in about a second on a GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in (SHAPES[shape] if isinstance(shape, str) else shape).items() if k != "torch_dtype"}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
