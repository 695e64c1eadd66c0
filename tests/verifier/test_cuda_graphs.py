"""The host side of the CUDA graphs (deploy/verifier/cuda/graphs.py), on the CPU: which graph a
forward runs in, and that a graph's static inputs say what the batch says: each real row attends
exactly its keys through the padded plan, padding rows attend nothing and write only the pool's
scratch slot. (Capture and replay run in tests/verifier/test_cuda.py, on a GPU.)"""

from __future__ import annotations

import random

import pytest
import torch

from deploy.errors import KVCapacityExceeded
from deploy.verifier.attention import torch_attention
from deploy.verifier.batch import chunk_input, pack, tree_input
from deploy.verifier.cuda.graphs import (MAX_INTS, MIN_PAGES, MIN_WIDTH, ROW_BUCKETS, GraphShape, StaticPlan,
                                         bucket_rows, fill_inputs, pow2_at_least)
from deploy.verifier.kv_pool import KVPool
from deploy.verifier.native import PAGE_SIZE
from deploy.verifier.tree import DraftTree

Hq, Hkv, D = 4, 2, 8


def test_a_forward_runs_in_the_smallest_bucket_that_holds_it():
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 17, 128, 129, 300, 528)] == [1, 2, 4, 8, 32, 128, 256, 384, 640]
    largest = ROW_BUCKETS[-1]
    assert bucket_rows(largest) == largest and bucket_rows(largest + 1) is None
    assert [pow2_at_least(n, 64) for n in (1, 64, 65, 1000)] == [64, 64, 128, 1024]
    assert GraphShape.of(3, 70, 5) == GraphShape(4, 128, 8)
    assert GraphShape.of(1, 1, 1) == GraphShape(1, MIN_WIDTH, MIN_PAGES)
    assert GraphShape.of(272, 1041, 66) == GraphShape(384, 2048, 128)  # 16 sessions x 16 nodes at prefix 1024
    assert GraphShape.of(largest + 1, 10, 1) is None  # past the largest bucket: eager
    wide = GraphShape(largest, 8192, 1024)
    assert wide.num_ints > MAX_INTS and GraphShape.of(largest, 8000, 600) is None  # inputs too large: eager


def test_fields_tile_the_buffer_without_overlap():
    shape = GraphShape(4, 64, 8)
    buf = torch.arange(shape.num_ints)
    f = shape.fields(buf)
    seen = torch.cat([t.reshape(-1) for t in f.values()])
    assert sorted(seen.tolist()) == list(range(shape.num_ints))
    assert f["bt"].shape == (4, 8) and f["pos"].shape == (4, 64)


def _random_tree(rng: random.Random, n: int, vocab: int):
    """tokens, parents, depths of a random n-node tree (tree_input's arguments)."""
    parents = [rng.randrange(-1, j) for j in range(n)]
    return [rng.randrange(vocab) for _ in range(n)], parents, list(DraftTree((0,) * n, tuple(parents)).depths)


def _batch(rng: random.Random, pool: KVPool):
    """A packed batch of a prefill chunk, decode roots and trees over sessions of random length."""
    items = []
    for i in range(rng.randint(1, 5)):
        sid = f"s{i}"
        start = rng.randint(0, 90)
        kind = rng.choice(["chunk", "root", "tree"])
        if kind == "chunk":
            it = chunk_input(sid, start, [rng.randrange(50) for _ in range(rng.randint(1, 20))])
        else:
            toks, parents, depths = _random_tree(rng, 0 if kind == "root" else rng.randint(1, 20), 50)
            it = tree_input(sid, start, rng.randrange(50), toks, parents, depths)
        pool.reserve(sid, max(it.write_at) + 1)
        items.append(it)
    return pack(items, pool)


def _static_attention(q, k_pages, v_pages, plan: StaticPlan, rows: int, scale: float) -> torch.Tensor:
    """What the Triton kernel computes from a graph's plan, in torch: row r attends the keys at
    positions[r, :lengths[r]] of session row_seq[r] (float32, one row at a time)."""
    out = torch.zeros(rows, Hq, D)
    for r in range(rows):
        n = int(plan.lengths[r])
        if not n:
            continue
        pos = plan.positions[r, :n]
        page = plan.block_table[plan.row_seq[r], pos // PAGE_SIZE]
        off = pos % PAGE_SIZE
        k = k_pages[page, :, :, off].float()  # [n, Hkv, D]
        v = v_pages[page, :, off, :].float()
        qr = q[r].float().view(Hkv, Hq // Hkv, D)
        w = torch.softmax(torch.einsum("gjd,ngd->gjn", qr, k) * scale, -1)
        out[r] = torch.einsum("gjn,ngd->gjd", w, v).reshape(Hq, D)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_a_graphs_inputs_give_each_real_row_its_keys_and_padding_rows_none(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(1, Hkv, D, 4096, torch.float32)
    scratch = pool.scratch_slot()
    batch = _batch(rng, pool)
    N, plan = batch.num_tokens, batch.plan
    shape = GraphShape.of(N, plan.max_len, plan.block_table.shape[1])
    buf = torch.full((shape.num_ints,), -7, dtype=torch.long)  # stale values: must not matter
    f = shape.fields(buf)
    used = fill_inputs(f, batch, scratch)
    assert used <= shape.num_ints
    fresh = torch.full_like(buf, -7)
    fresh[:used] = buf[:used]  # only the ints a replay's copy carries
    f = shape.fields(fresh)
    assert torch.equal(f["ids"][:N], batch.input_ids) and torch.equal(f["rope_pos"][:N], batch.positions)
    assert torch.equal(f["page"][:N] * PAGE_SIZE + f["off"][:N], batch.slots)
    pad = slice(N, shape.rows)
    assert (f["page"][pad] * PAGE_SIZE + f["off"][pad] == scratch).all()  # padding rows write scratch only
    assert (f["lengths"][pad] == 0).all() and (f["ids"][pad] == 0).all()
    assert not any(scratch // PAGE_SIZE in s.pages for s in pool.sessions.values())

    k_pages = torch.randn(pool.num_pages, Hkv, D, PAGE_SIZE)
    v_pages = torch.randn(pool.num_pages, Hkv, PAGE_SIZE, D)
    q = torch.randn(shape.rows, Hq, D)
    static = StaticPlan(f["bt"], f["seq"], f["pos"], f["lengths"])
    got = _static_attention(q, k_pages, v_pages, static, shape.rows, D ** -0.5)
    want = torch_attention(q[:N], k_pages, v_pages, plan, D ** -0.5)
    assert torch.allclose(got[:N], want, atol=1e-5)
    assert (got[N:] == 0).all()


def test_the_scratch_page_is_taken_once_and_is_no_sessions():
    pool = KVPool(1, Hkv, D, 4 * PAGE_SIZE, torch.float32)
    slot = pool.scratch_slot()
    assert pool.scratch_slot() == slot and slot % PAGE_SIZE == 0
    assert pool.pages_in_use == 0
    pool.reserve("a", 3 * PAGE_SIZE)  # the three pages left
    with pytest.raises(KVCapacityExceeded):
        pool.reserve("b", 1)
    assert slot // PAGE_SIZE not in pool.sessions["a"].pages
    full = KVPool(1, Hkv, D, PAGE_SIZE, torch.float32)
    full.reserve("a", 1)
    with pytest.raises(KVCapacityExceeded):
        full.scratch_slot()
