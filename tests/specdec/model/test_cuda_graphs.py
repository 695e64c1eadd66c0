"""The host side of the CUDA graphs (specdec/model/cuda/graphs.py): which graph a forward runs
in, and that a graph's static inputs say what the batch says: the attention kernel (on a GPU, or
under Triton's interpreter) gives each real row of the padded plan exactly its keys, padding rows
attend nothing and write only the pool's scratch slot. (Capture and replay run in
tests/specdec/model/test_cuda.py, on a GPU.)"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import KVCapacityExceeded
from specdec.model.attention import torch_attention
from specdec.model.batch import chunk_input, pack, tree_input
from specdec.model.cuda.graphs import (MAX_INTS, MIN_PAGES, MIN_WIDTH, ROW_BUCKETS, GraphShape, bucket_rows,
                                         fill_inputs, pow2_at_least)
from specdec.model.cuda.plan import CHUNK, rows_per_tile, session_tiles
from specdec.model.kv_pool import KVPool
from specdec.model.native import PAGE_SIZE
from specdec.tree import DraftTree
from tests.specdec.model.interpreted import kernels_and_device

Hq, Hkv, D = 4, 2, 16
RPT = rows_per_tile(Hq, Hkv)


def test_a_forward_runs_in_the_smallest_bucket_that_holds_it():
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 17, 128, 129, 300, 528)] == [1, 2, 4, 8, 32, 128, 256, 384, 640]
    largest = ROW_BUCKETS[-1]
    assert bucket_rows(largest) == largest and bucket_rows(largest + 1) is None
    assert [pow2_at_least(n, 64) for n in (1, 64, 65, 1000)] == [64, 64, 128, 1024]
    assert GraphShape.of(3, 2, RPT, 70, 5) == GraphShape(4, 2, RPT, 128, 8)
    assert GraphShape.of(1, 1, RPT, 1, 1) == GraphShape(1, 1, RPT, MIN_WIDTH, MIN_PAGES)
    # 16 sessions x 16 nodes at prefix 1024: 272 rows in 32 tiles; keys up to 2048 wide (4 chunks)
    shape = GraphShape.of(272, 32, RPT, 1041, 66)
    assert shape == GraphShape(384, 32, RPT, 2048, 128) and shape.chunks == 2048 // CHUNK
    assert GraphShape.of(5, 5, RPT, 10, 1).tiles == 8 and GraphShape.of(3, 3, RPT, 10, 1).tiles == 4
    assert GraphShape.of(largest + 1, 1, RPT, 10, 1) is None  # past the largest bucket: eager
    wide = GraphShape(largest, largest, RPT, 8192, 4096)
    assert wide.num_ints > MAX_INTS and GraphShape.of(largest, largest, RPT, 8000, 4000) is None  # too large: eager


def test_fields_tile_the_buffer_without_overlap():
    shape = GraphShape(4, 2, RPT, 64, 8)
    buf = torch.arange(shape.num_ints)
    f = shape.fields(buf)
    seen = torch.cat([t.reshape(-1) for t in f.values()])
    assert sorted(seen.tolist()) == list(range(shape.num_ints))
    assert f["bt"].shape == (4, 8) and f["tiles"].shape == (2, RPT)


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


@pytest.mark.parametrize("seed", range(8))
def test_a_graphs_inputs_give_each_real_row_its_keys_and_padding_rows_none(seed):
    kernels, device = kernels_and_device()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(1, Hkv, D, 4096, torch.float32)
    scratch = pool.scratch_slot()
    batch = _batch(rng, pool)
    N, plan = batch.num_tokens, batch.plan
    tiles = session_tiles(plan.row_seq, RPT)
    shape = GraphShape.of(N, len(tiles), RPT, plan.max_len, plan.block_table.shape[1])
    buf = torch.full((shape.num_ints,), -7, dtype=torch.long)  # stale values: must not matter
    used = fill_inputs(shape.fields(buf), batch, tiles, scratch)
    assert used <= shape.num_ints
    fresh = torch.full_like(buf, -7)
    fresh[:used] = buf[:used]  # only the ints a replay's copy carries
    f = shape.fields(fresh)
    assert torch.equal(f["ids"][:N], batch.input_ids) and torch.equal(f["rope_pos"][:N], batch.positions)
    assert torch.equal(f["page"][:N] * PAGE_SIZE + f["off"][:N], batch.slots)
    pad = slice(N, shape.rows)
    assert (f["page"][pad] * PAGE_SIZE + f["off"][pad] == scratch).all()  # padding rows write scratch only
    assert (f["ids"][pad] == 0).all() and not (f["tiles"] >= N).any()  # padding rows are in no tile
    assert not any(scratch // PAGE_SIZE in s.pages for s in pool.sessions.values())

    k_pages = torch.randn(pool.num_pages, Hkv, D, PAGE_SIZE)
    v_pages = torch.randn(pool.num_pages, Hkv, PAGE_SIZE, D)
    q = torch.randn(shape.rows, Hq, D)
    got = kernels.tree_attention(q.to(device), k_pages.to(device), v_pages.to(device),
                                 shape.plan({k: t.to(device) for k, t in f.items()}), D ** -0.5).cpu()
    want = torch_attention(q[:N].double(), k_pages.double(), v_pages.double(), plan, D ** -0.5)
    assert (got[:N].double() - want).abs().max() < 1e-5
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
