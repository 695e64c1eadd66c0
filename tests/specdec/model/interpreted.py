"""Where the CUDA path's Triton kernels run in the tests: on a GPU where there is one, else under
Triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` before Triton is
imported) on CPU tensors, so ``make test`` checks their logic, masks and indexing without a GPU
(not their speed, nor the GPU's bits: ``tests/specdec/model/test_cuda.py`` does that on a device)."""

from __future__ import annotations

import os

import pytest
import torch


def _interpreter_fixes() -> None:
    """Three gaps of Triton 3.6's interpreter: a scalar loop bound becomes an int through
    ``int(array([x]))``, which numpy >= 2.4 refuses (give tensors an ``__index__`` that takes the
    one element); ``tl.dot`` multiplies bfloat16 operands as their raw uint16 bits; and it runs
    BLAS, whose rounding of a row depends on the row's place in the tile. Here ``tl.dot`` is each
    output element's own sum of exact products (float64), plus the accumulator: a function of one
    row of A, one column of B and one element of C, as a tensor core's MMA is (the property the
    kernel's batch invariance rests on; the GPU tests check it on the device)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_specedge_fixes", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widened(h) -> np.ndarray:
        if h.dtype == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return h.data.astype(np.float64)

    def patched_dot(self, a, b, d, *args):
        prod = widened(a)[:, :, None] * widened(b)[None, :, :]  # [M, K, N], exact
        out = (prod.sum(axis=1).astype(d.data.dtype) + d.data).astype(d.data.dtype)
        return interpreter.TensorHandle(out, d.dtype.scalar)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    _nested_calls_without_repatching(interpreter)
    interpreter._specedge_fixes = True


def _nested_calls_without_repatching(interpreter) -> None:
    """Speed only: every device-function call (``_block_step``, ``tl.sum``) re-patches triton.language for its
    module (``inspect.getmembers`` of four modules: a third of the interpreter's time in the tree attention), though
    the launch running it, or an earlier call in it, patched those same modules already: patch once per launch."""
    import triton.language as tl

    launch, nested = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    active: list[set] = []  # per launch running: the language modules patched in it

    def langs(fn) -> frozenset:  # what _patch_lang(fn) patches: the triton.language modules fn sees
        return frozenset(id(m) for m in fn.__globals__.values() if m is tl or m is tl.core)

    def patched_launch(self, *args, **kwargs):
        active.append({langs(self.fn)})
        try:
            return launch(self, *args, **kwargs)
        finally:
            active.pop()

    def patched_nested(self, *args, **kwargs):
        if not active or langs(self.fn) not in active[-1]:
            if active:
                active[-1].add(langs(self.fn))
            return nested(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = patched_launch
    interpreter.InterpretedFunction.__call__ = patched_nested


def kernels_and_device():
    """(:mod:`specdec.model.cuda.kernels`, the device its tensors go on); skips the test where
    Triton is missing, or where there is neither a GPU nor the interpreter."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _interpreter_fixes()
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        pytest.skip("no GPU, and Triton was imported before TRITON_INTERPRET=1 was set")
    from specdec.model.cuda import kernels

    return kernels, device
