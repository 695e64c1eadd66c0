"""One pipeline stage (deploy/verifier/pipeline_stage.py): a stage loads only its slice of a real
checkpoint, and two stages chained compute what the whole model does."""

from __future__ import annotations

import pytest
import torch

from deploy.config import ModelConfig
from deploy.verifier.pipeline_stage import load_stage
from specdec.model.batch import chunk_input
from specdec.model.runner import ModelRunner


@pytest.mark.slow
def test_stage_loads_only_its_slice_of_the_embedded_checkpoint(embedded):
    cfg = ModelConfig(model="embedded", dtype="float32", device="cpu")
    full = ModelRunner(embedded.model)
    n_full = sum(p.numel() for p in embedded.model.parameters())
    s0, s1 = load_stage(cfg, 0, 19, with_tokenizer=True), load_stage(cfg, 19, 30)
    n0 = sum(p.numel() for p in s0.model.parameters())
    n1 = sum(p.numel() for p in s1.model.parameters())
    assert n0 < n_full and n1 < n_full and n0 + n1 > n_full  # tied head: the embedding on both ends
    assert s0.eos_token_ids == embedded.eos_token_ids and s0.tokenizer is not None
    r0, r1 = ModelRunner(s0.model, 0, 19), ModelRunner(s1.model, 19, 30)
    ids = embedded.tokenizer("The capital of France is", return_tensors=None)["input_ids"]
    item = chunk_input("x", 0, ids, list(range(len(ids))))
    want = full.forward(0, [item])[0]
    got = r1.forward(0, [item], r0.forward(0, [item]))[0]
    assert torch.equal(want, got)
