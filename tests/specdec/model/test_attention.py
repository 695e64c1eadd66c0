"""Tree attention: the C kernel agrees with the torch reference, and a row's output is
bit-identical whatever the batch, the tree's layout, the page placement or the thread count
(the kernel reduces each row over its logical sequence in a fixed order, alone or in a group of
a tree's rows)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.model.attention import AttentionPlan, torch_attention, tree_attention, use_kernel
from specdec.model.batch import ancestor_bits, signed64
from specdec.model.native import PAGE_SIZE

pytestmark = pytest.mark.skipif(not use_kernel(torch.device("cpu"), torch.float32),
                                reason="the tree-attention kernel could not be built here")
Hq, Hkv, D = 6, 2, 64


def _pages(n_pages: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_pages, Hkv, D, PAGE_SIZE, generator=g).to(dtype)
    v = torch.randn(n_pages, Hkv, PAGE_SIZE, D, generator=g).to(dtype)
    return k, v


def _plan(tables, rows):
    """tables: per session a list of pages; rows: (session, row_len, bits)."""
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    lens = [r[1] + bin(r[2] & (2 ** 64 - 1)).count("1") for r in rows]
    return AttentionPlan(bt, torch.tensor([r[0] for r in rows], dtype=torch.int32),
                         torch.tensor([r[1] for r in rows], dtype=torch.int32),
                         torch.tensor([r[2] for r in rows], dtype=torch.int64), max(lens))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_the_torch_reference(dtype, tol):
    k, v = _pages(12, dtype)
    parents = [-1, -1, 0, 2, 1, 3]
    bits = [signed64(b) for b in ancestor_bits(parents)]
    plan = _plan([[0, 1, 2, 3], [7, 5, 9]], [(0, 40, 0)] + [(0, 40, b) for b in bits] + [(1, 1, 0), (1, 33, 0)])
    q = torch.randn(len(bits) + 3, Hq, D).to(dtype)
    a, b = tree_attention(q, k, v, plan, D ** -0.5, kernel=True), torch_attention(q, k, v, plan, D ** -0.5)
    assert (a.float() - b.float()).abs().max() < tol


@pytest.mark.parametrize("length", [1, 15, 16, 17, 31, 40, 47])
def test_the_softmax_max_is_found_wherever_the_largest_score_lies(length):
    # scores hundreds apart: a max that missed one lane or the tail past the last whole vector
    # would leave exp of a large positive number (inf or garbage), far from the stable reference
    k, v = _pages(4, torch.float32, seed=length)
    plan = _plan([[2, 0, 3, 1]], [(0, length, 0)])
    g = torch.Generator().manual_seed(length)
    for scale in (20.0, 60.0):
        q = torch.randn(1, Hq, D, generator=g)
        a = tree_attention(q, k, v, plan, scale, kernel=True)
        b = torch_attention(q, k, v, plan, scale)
        assert torch.isfinite(a).all() and (a - b).abs().max() < 1e-4


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 90), st.lists(st.integers(-1, 40), min_size=1, max_size=40), st.integers(0, 2 ** 31),
       st.sampled_from([torch.bfloat16, torch.float32]), st.integers(1, 2), st.booleans())
def test_a_tree_row_equals_the_same_sequence_decoded_contiguously(prefix, raw_parents, seed, dtype, threads, grouped):
    """Row j of a tree (prefix + ancestors, scattered in the pool, batched with other rows) is
    bit-identical to one row over the same keys laid out contiguously on other pages. ``grouped``:
    the tree's rows consecutive, as the engine lays them out (the kernel attends them as one
    group, each prefix page converted once for all), else shuffled among the other rows."""
    rng = random.Random(seed)
    parents = [p if p < j else -1 for j, p in enumerate(raw_parents)]
    n = len(parents)
    k, v = _pages(32, dtype, seed % 1000)
    bits = ancestor_bits(parents)
    tree_pages = rng.sample(range(16), -(-(prefix + n) // PAGE_SIZE))
    other = [rng.randrange(16) for _ in range(3)]
    rows = [(0, prefix, signed64(b)) for b in bits] + [(1, rng.randint(1, 40), 0)]
    if not grouped:
        rng.shuffle(rows)
    q = torch.randn(len(rows), Hq, D, generator=torch.Generator().manual_seed(seed % 1000)).to(dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = tree_attention(q, k, v, _plan([tree_pages, other], rows), D ** -0.5, kernel=True)
        for r, (sess, _len, b) in enumerate(rows):
            if sess != 0:
                continue
            # copy the row's logical sequence (prefix, then its ancestors) to fresh pages 16..
            anc = [j for j in range(n) if (b >> j) & 1]
            seq = list(range(prefix)) + [prefix + j for j in anc]
            k2, v2 = k.clone(), v.clone()
            for i, p in enumerate(seq):
                sp, so = tree_pages[p // PAGE_SIZE], p % PAGE_SIZE
                dp, do = 16 + i // PAGE_SIZE, i % PAGE_SIZE
                k2[dp, :, :, do], v2[dp, :, do, :] = k[sp, :, :, so], v[sp, :, so, :]
            alone = tree_attention(q[r: r + 1], k2, v2, _plan([list(range(16, 32))], [(0, len(seq), 0)]),
                                   D ** -0.5, kernel=True)
            assert torch.equal(alone[0], out[r])
    finally:
        torch.set_num_threads(old)
