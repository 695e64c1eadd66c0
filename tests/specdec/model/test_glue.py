"""The layer glue: the native bf16 functions (csrc/glue.c) against the torch ones, and their
row invariance (a row's result does not depend on the rows beside it)."""

from __future__ import annotations

import pytest
import torch

from specdec.model.glue import Glue, NativeGlue, make_glue, use_native
from specdec.model.kv_pool import KVPool

pytestmark = pytest.mark.skipif(not use_native(torch.device("cpu"), torch.bfloat16),
                                reason="native kernels not built here")

D, I, HQ, HKV, HD = 192, 320, 6, 2, 32


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 2).bfloat16()  # noqa: E731
    pos = torch.randint(0, 4000, (n,), generator=g).float()
    freqs = pos[:, None] * (10000 ** (-torch.arange(0, HD, 2).float() / HD))[None]
    emb = torch.cat([freqs, freqs], -1)
    return dict(h=r(n, D), delta=r(n, D), w=r(D), gate_up=r(n, 2 * I), qkv=r(n, HQ + 2 * HKV, HD),
                cos=emb.cos().bfloat16()[:, None], sin=emb.sin().bfloat16()[:, None])


def _rope(glue, x, n):
    pool = KVPool(1, HKV, HD, 64 * 16, torch.bfloat16, "cpu")
    pool.k.zero_(), pool.v.zero_()
    where = pool.locate(torch.arange(n) * 7 + 3)
    q = glue.rope_write(x["qkv"], x["cos"], x["sin"], HQ, HKV, None, None, 1e-5, pool, 0, where)
    return q, pool.k, pool.v


@pytest.mark.parametrize("n", [1, 5, 40])
def test_native_glue_equals_the_torch_glue(n):
    x = _inputs(n)
    t, c = Glue(), NativeGlue()
    h_t, x_t = t.residual_norm(x["h"], x["delta"], x["w"], 1e-5)
    h_c, x_c = c.residual_norm(x["h"], x["delta"], x["w"], 1e-5)
    assert torch.equal(h_t, h_c)
    assert torch.equal(x_t, x_c)
    assert torch.equal(t.norm(x["h"], x["w"], 1e-5), c.norm(x["h"], x["w"], 1e-5))
    for a, b in zip(_rope(t, x, n), _rope(c, x, n)):
        assert torch.equal(a, b)
    # SwiGLU: our exp and torch's differ in the last float32 bit at most; after bf16 rounding
    # almost every value is identical and none is off by more than one bf16 step
    s_t, s_c = t.swiglu(x["gate_up"]).float(), c.swiglu(x["gate_up"]).float()
    assert ((s_t - s_c).abs() <= s_t.abs() * 2 ** -7 + 1e-30).all()
    assert (s_t != s_c).float().mean() < 0.01


def test_native_glue_leaves_its_inputs_alone():
    x = _inputs(4)
    before = {k: v.clone() for k, v in x.items()}
    NativeGlue().residual_norm(x["h"], x["delta"], x["w"], 1e-5)
    NativeGlue().swiglu(x["gate_up"])
    for k in x:
        assert torch.equal(x[k], before[k]), k


def test_native_glue_rows_do_not_depend_on_the_batch():
    x = _inputs(33)
    c = NativeGlue()
    h, xn = c.residual_norm(x["h"], x["delta"], x["w"], 1e-5)
    s = c.swiglu(x["gate_up"])
    for r in (0, 7, 32):
        h1, x1 = c.residual_norm(x["h"][r: r + 1].clone(), x["delta"][r: r + 1].clone(), x["w"], 1e-5)
        assert torch.equal(h1[0], h[r]) and torch.equal(x1[0], xn[r])
        assert torch.equal(c.swiglu(x["gate_up"][r: r + 1].clone())[0], s[r])


def test_glue_choice():
    assert isinstance(make_glue(torch.device("cpu"), torch.bfloat16), NativeGlue)
    assert type(make_glue(torch.device("cpu"), torch.float32)) is Glue
