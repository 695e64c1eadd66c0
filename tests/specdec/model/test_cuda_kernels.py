"""The CUDA tree attention (specdec/model/cuda/kernels.py) on a GPU, or under Triton's
interpreter without one (tests/specdec/model/interpreted.py): it equals a float64 reference over
random trees, prefill chunks and decode rows, prefixes across chunk and page boundaries, GQA
groups 1-8 and sessions with more rows than a tile; and a row's output has the same bits alone,
among other sessions, inside its tree, or decoded over the same keys laid out contiguously."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.model.attention import AttentionPlan, torch_attention
from specdec.model.batch import ancestor_bits, signed64
from specdec.model.cuda.plan import BLOCK_M, CHUNK, DevicePlan, rows_per_tile
from specdec.model.native import PAGE_SIZE
from tests.specdec.model.interpreted import kernels_and_device
from tests.specdec.model.test_attention import _plan  # tables: each session's pages; rows: (session, row_len, bits)

KV_HEADS, D = 2, 32
POOL_PAGES = 600


def _pool(dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(POOL_PAGES, KV_HEADS, D, PAGE_SIZE, generator=g).to(dtype)  # [pages, Hkv, D, PS]
    v = torch.randn(POOL_PAGES, KV_HEADS, PAGE_SIZE, D, generator=g).to(dtype)  # [pages, Hkv, PS, D]
    return k, v


def _random_parents(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(-1, j - 1) for j in range(n)]


def _session_rows(rng: random.Random, kind: str, start: int, n: int) -> list[tuple[int, int]]:
    """(row_len, bits) of a session's rows: a tree (root + n nodes), a prefill chunk of n rows, a decode root."""
    if kind == "tree":
        return [(start + 1, 0)] + [(start + 1, signed64(b)) for b in ancestor_bits(_random_parents(rng, n))]
    if kind == "chunk":
        return [(start + 1 + i, 0) for i in range(n)]
    return [(start + 1, 0)]


def _random_batch(rng: random.Random, sessions: int, max_nodes: int, pages=range(POOL_PAGES)):
    """Sessions of random kinds on disjoint random ``pages``; rows shuffled across sessions."""
    free = list(pages)
    rng.shuffle(free)
    tables, rows = [], []
    for b in range(sessions):
        kind = rng.choice(["tree", "tree", "chunk", "root"])
        start = rng.choice([rng.randint(0, 60), rng.randint(CHUNK - 40, CHUNK + 40), rng.randint(1000, 1100)])
        sr = _session_rows(rng, kind, start, rng.randint(1, max_nodes))
        need = max(rl + (64 if bits else 0) for rl, bits in sr)
        tables.append([free.pop() for _ in range(-(-need // PAGE_SIZE))])
        rows += [(b, rl, bits) for rl, bits in sr]
    rng.shuffle(rows)
    return tables, rows


def _attend(kernels, device, q, k, v, plan: AttentionPlan, block_m: int = BLOCK_M) -> torch.Tensor:
    Hq = q.shape[1]
    dp = DevicePlan.of(plan, device, Hq, KV_HEADS, block_m)
    return kernels.tree_attention(q.to(device), k.to(device), v.to(device), dp, D ** -0.5).cpu()


@pytest.mark.parametrize("group, dtype, tol, block_m",
                         [(g, torch.bfloat16, 2e-2, BLOCK_M) for g in (1, 2, 3, 4, 5, 8)]
                         + [(g, torch.float32, 2e-5, BLOCK_M) for g in (3, 8)]
                         + [(g, torch.bfloat16, 2e-2, 32) for g in (4, 5)])  # the 32-head tile of sm_8x / sm_12x
def test_kernel_equals_a_float64_reference(group, dtype, tol, block_m):
    kernels, device = kernels_and_device()
    rng = random.Random(group * 7 + (dtype == torch.float32))
    Hq = group * KV_HEADS
    k, v = _pool(dtype, group)
    tables, rows = _random_batch(rng, 3, rows_per_tile(Hq, KV_HEADS, block_m) + 5)  # some sessions past one tile
    plan = _plan(tables, rows)
    q = torch.randn(len(rows), Hq, D, generator=torch.Generator().manual_seed(group)).to(dtype)
    got = _attend(kernels, device, q, k, v, plan, block_m)
    want = torch_attention(q.double(), k.double(), v.double(), plan, D ** -0.5)
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() < tol


@pytest.mark.parametrize("seed", range(4))
def test_a_rows_bits_do_not_depend_on_its_batch_or_its_trees_layout(seed):
    """A tree row equals, bit for bit: the same tree alone; and one decode row whose prefix holds
    the same keys contiguously (its logical sequence) on other pages."""
    kernels, device = kernels_and_device()
    rng = random.Random(100 + seed)
    group = [1, 4, 5, 8][seed]
    Hq = group * KV_HEADS
    k, v = _pool(torch.bfloat16, seed)
    prefix = rng.choice([rng.randint(1, 40), rng.randint(CHUNK - 20, CHUNK + 20), rng.randint(1000, 1060)])
    parents = _random_parents(rng, min(64, rng.randint(rows_per_tile(Hq, KV_HEADS), rows_per_tile(Hq, KV_HEADS) + 8)))
    tree = [(prefix, 0)] + [(prefix, signed64(b)) for b in ancestor_bits(parents)]
    n = len(parents)
    tree_pages = list(range(0, -(-(prefix + n) // PAGE_SIZE)))
    q_tree = torch.randn(len(tree), Hq, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)

    alone = _attend(kernels, device, q_tree, k, v, _plan([tree_pages], [(0, rl, b) for rl, b in tree]))

    others, other_rows = _random_batch(rng, 3, 20, pages=range(100, 400))
    rows = [(0, rl, b) for rl, b in tree] + [(s + 1, rl, b) for s, rl, b in other_rows]
    order = list(range(len(rows)))
    rng.shuffle(order)
    q_other = torch.randn(len(other_rows), Hq, D).to(torch.bfloat16)
    q_all = torch.cat([q_tree, q_other])[order]
    batched = _attend(kernels, device, q_all, k, v, _plan([tree_pages] + others, [rows[i] for i in order]))
    back = torch.empty_like(batched)
    back[order] = batched
    assert torch.equal(back[: len(tree)], alone)

    for j in rng.sample(range(1, len(tree)), 2):  # node j - 1 decoded over its sequence, contiguous
        row_len, bits = tree[j]
        seq = list(range(prefix)) + [prefix + i for i in range(n) if (bits >> i) & 1]
        k2, v2 = k.clone(), v.clone()
        for i, p in enumerate(seq):
            page, off = tree_pages[p // PAGE_SIZE], p % PAGE_SIZE
            k2[500 + i // PAGE_SIZE, :, :, i % PAGE_SIZE] = k[page, :, :, off]
            v2[500 + i // PAGE_SIZE, :, i % PAGE_SIZE, :] = v[page, :, off, :]
        decoded = _attend(kernels, device, q_tree[j: j + 1], k2, v2,
                          _plan([list(range(500, 500 + -(-len(seq) // PAGE_SIZE)))], [(0, len(seq), 0)]))
        assert torch.equal(decoded[0], alone[j])
