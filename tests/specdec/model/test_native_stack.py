"""The layer stack in one native call gives the per-op forward's bits: logits, hidden states of a
pipeline stage and every K/V it writes into the pool, for prompt chunks and trees of several
sessions in one batch, with and without biases, one and two threads."""

from __future__ import annotations

import pytest
import torch

from specdec.model.batch import chunk_input, tree_input
from specdec.model.decoder import DecoderModel
from specdec.model.native_stack import NativeStack
from specdec.model.runner import ModelRunner
from tests.specdec.model.test_decoder import _build, needs_native_linear


def _pair(over: dict, first: int = 0, last: int | None = None) -> tuple[ModelRunner, ModelRunner]:
    hf = _build("Llama", **over).to(torch.bfloat16)
    fused, per_op = DecoderModel(hf, first, last), DecoderModel(hf, first, last)
    assert fused.stack is not None
    per_op.stack = None
    return ModelRunner(fused, kv_capacity_tokens=1024), ModelRunner(per_op, kv_capacity_tokens=1024)


def _same(a, b) -> None:
    assert len(a) == len(b) if isinstance(a, list) else True
    for x, y in zip(a, b) if isinstance(a, list) else [(a, b)]:
        assert x.dtype == y.dtype and torch.equal(x.view(torch.int16), y.view(torch.int16))


@needs_native_linear
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("over", [{}, {"attention_bias": True, "mlp_bias": True}])
def test_stack_matches_the_per_op_forward_bit_for_bit(threads, over):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runners = _pair(over)
        g = torch.Generator().manual_seed(1)
        prompts = {f"s{i}": torch.randint(0, 256, (n,), generator=g).tolist() for i, n in enumerate((40, 7, 23))}
        outs = [r.forward(0, [chunk_input(sid, 0, ids, list(range(len(ids)))) for sid, ids in prompts.items()])
                for r in runners]
        _same(*outs)
        for r in runners:
            r.commit(0, {sid: (len(ids), []) for sid, ids in prompts.items()})
        trees = [tree_input(sid, len(ids), ids[-1], [5, 9, 11, 3], [-1, -1, 0, 2], [1, 1, 2, 3])
                 for sid, ids in prompts.items()]
        _same(*[r.forward(1, trees) for r in runners])
        for layer in range(2):
            for sid in prompts:
                _same(*[r.pool.read(sid)[0][layer] for r in runners])
                _same(*[r.pool.read(sid)[1][layer] for r in runners])
    finally:
        torch.set_num_threads(old)


@needs_native_linear
def test_a_pipeline_stage_hands_on_the_same_hidden_states():
    runners = _pair({}, 0, 1)
    ids = list(range(3, 30))
    _same(*[r.forward(0, [chunk_input("s", 0, ids)]) for r in runners])


def test_qwen3_q_k_norms_keep_the_per_op_path():
    hf = _build("Qwen3", head_dim=32).to(torch.bfloat16)
    assert not NativeStack.supports(DecoderModel(hf))


class _Recorder:
    """An exit-head-like hook: names its ``layers`` and keeps a copy of h after each of them."""

    def __init__(self, layers):
        self.layers = frozenset(layers)
        self.seen: list[tuple[int, torch.Tensor]] = []

    def __call__(self, n: int, h: torch.Tensor, batch) -> None:
        if n in self.layers:
            self.seen.append((n, h.clone()))


@needs_native_linear
def test_exit_hooks_see_the_per_op_hidden_states_between_segments():
    runners = _pair({"num_hidden_layers": 4})
    hooks = [_Recorder((1, 3)) for _ in runners]
    ids = list(range(3, 40))
    _same(*[r.forward(0, [chunk_input("s", 0, ids)], on_layer=hk) for r, hk in zip(runners, hooks)])
    assert [n for n, _ in hooks[0].seen] == [n for n, _ in hooks[1].seen] == [1, 3]
    _same([h for _, h in hooks[0].seen], [h for _, h in hooks[1].seen])
