"""verifier.attention_backend: the Triton kernel where it runs, else torch's SDPA over the gathered pages with the
tree mask, chosen with one log line saying why (no Triton, a card outside the compiled classes); "sdpa" on request.
On CPU: the selection, and the forward with SDPA equal to the forward with the Triton kernel (under Triton's
interpreter) in fp32: logits within fp32 tolerance, the same greedy tokens."""

from __future__ import annotations

import logging

import pytest
import torch

from specdec.model import cuda
from specdec.model.attention import select_backend
from specdec.model.batch import chunk_input, tree_input
from specdec.model.decoder import DecoderModel
from specdec.model.runner import ModelRunner
from tests.specdec.model.interpreted import kernels_and_device
from tests.specdec.model.test_decoder import _build

GPU = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


def test_sdpa_is_chosen_on_request_anywhere_and_other_names_are_refused():
    assert select_backend(torch.device("cpu"), torch.float32, 4, 2, 16, "sdpa") == (False, None)
    assert select_backend(GPU, torch.bfloat16, 32, 8, 128, "sdpa") == (False, None)
    with pytest.raises(ValueError, match="triton, sdpa"):
        select_backend(torch.device("cpu"), torch.float32, 4, 2, 16, "flash")


def test_without_triton_the_gpu_falls_back_to_sdpa_saying_why(monkeypatch):
    monkeypatch.setattr(cuda, "_triton_importable", lambda: False)
    assert select_backend(GPU, torch.bfloat16, 32, 8, 128) == (False, "Triton is not installed")
    assert not cuda.available(GPU)


def test_a_card_outside_the_compiled_classes_falls_back_to_sdpa_naming_it(monkeypatch):
    assert cuda.unsupported((8, 0)) is None and cuda.unsupported((10, 0)) is None
    why = cuda.unsupported((7, 5), name="Tesla T4")
    assert "Tesla T4 (sm_75)" in why and "sm_80" in why and "sm_100" in why
    monkeypatch.setattr(cuda, "_triton_importable", lambda: True)
    monkeypatch.setattr(cuda, "_card_why_not", lambda index: cuda.unsupported((7, 0), name="Tesla V100"))
    kernel, why = select_backend(GPU, torch.bfloat16, 32, 8, 128)
    assert not kernel and "Tesla V100 (sm_70)" in why
    monkeypatch.setattr(cuda, "_card_why_not", lambda index: None)  # a supported card, a layout beyond the tile
    assert select_backend(GPU, torch.bfloat16, 32, 8, 128) == (True, None)
    kernel, why = select_backend(GPU, torch.bfloat16, 32, 8, 512)
    assert not kernel and "32/8 x 512" in why


def test_the_decoder_logs_one_line_saying_why_it_falls_back(monkeypatch, caplog):
    import specdec.model.decoder as decoder

    monkeypatch.setattr(decoder, "select_backend", lambda *a: (False, "Tesla T4 (sm_75) is not a card class ..."))
    with caplog.at_level(logging.WARNING, logger="specdec.model.decoder"):
        dm = DecoderModel(_build("Llama"))
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.model.decoder"]
    assert len(lines) == 1 and "SDPA" in lines[0] and "Tesla T4 (sm_75)" in lines[0], lines
    assert not dm.kernel and dm.attention_backend == "sdpa"


def test_the_config_takes_the_backend_and_refuses_it_where_it_is_not_wired():
    from deploy.config import AppConfig

    assert AppConfig().verifier.attention_backend == "triton"
    assert AppConfig(verifier={"attention_backend": "sdpa"}).verifier.attention_backend == "sdpa"
    with pytest.raises(ValueError):
        AppConfig(verifier={"attention_backend": "flash"})
    with pytest.raises(ValueError, match="one-process"):
        AppConfig(verifier={"attention_backend": "sdpa", "pipeline_parallel_size": 2, "kv_budget_tokens": 4096})


def _triton_attention(kernels, calls: list):
    """The decoder's attention through the CUDA path's Triton kernel (here under the interpreter, on CPU tensors)."""
    from specdec.model.cuda.plan import DevicePlan

    def attend(q, k_pages, v_pages, plan, scale, kernel=None):
        calls.append(q.shape[0])
        dp = DevicePlan.of(plan, q.device, q.shape[1], k_pages.shape[1])
        return kernels.tree_attention(q, k_pages, v_pages, dp, scale)

    return attend


def _greedy(runner: ModelRunner, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    logits = runner.forward(0, [chunk_input("s", 0, ids, list(range(len(ids))))])[0]
    runner.commit(0, {"s": (len(ids), [])})
    first = logits
    out = []
    for step in range(1, steps + 1):
        tok = int(logits[-1].argmax())
        out.append(tok)
        pos = len(ids) + step - 1
        logits = runner.forward(step, [chunk_input("s", pos, [tok])])[0]
        runner.commit(step, {"s": (1, [])})
    return out, first


def test_sdpa_gives_the_triton_kernels_logits_and_greedy_tokens_in_fp32(monkeypatch):
    kernels, _ = kernels_and_device()
    import specdec.model.decoder as decoder

    model = _build("Llama")  # fp32, 4 query heads on 2 KV heads, head dim 16
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    sdpa = ModelRunner(DecoderModel(model, attention_backend="sdpa"))
    assert not sdpa.model.kernel and sdpa.model.stack is None
    want_tokens, want_prefill = _greedy(sdpa, ids, 6)
    want_tree = sdpa.forward(7, [tree_input("s", len(ids) + 6, 5, [9, 3, 11], [-1, -1, 0], [1, 1, 2])])[0]

    calls: list[int] = []
    monkeypatch.setattr(decoder, "tree_attention", _triton_attention(kernels, calls))
    triton = ModelRunner(DecoderModel(model))
    got_tokens, got_prefill = _greedy(triton, ids, 6)
    got_tree = triton.forward(7, [tree_input("s", len(ids) + 6, 5, [9, 3, 11], [-1, -1, 0], [1, 1, 2])])[0]

    assert len(calls) == 2 * 8  # two layers, eight forwards: every attention ran the Triton kernel
    assert got_tokens == want_tokens
    assert (got_prefill - want_prefill).abs().max() < 1e-4
    assert (got_tree - want_tree).abs().max() < 1e-4
    assert torch.equal(got_tree.argmax(-1), want_tree.argmax(-1))
