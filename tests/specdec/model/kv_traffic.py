"""The bytes the CUDA tree attention moves, counted under Triton's interpreter (no GPU): every load and store the
kernels make is recorded (the interpreter's masked load / store, each lane a mask lets through), split into the KV
pool's keys and values, and the split-KV partials (float32 accumulators, maxima and sums) written for the merge;
compared with the floor, the K and V bytes of each session's distinct keys (its prefix and its tree's nodes) read
once. ``TRITON_INTERPRET=1 python -m tests.specdec.model.kv_traffic`` prints the table of docs/gpu_attention.md,
"KV traffic"; tests/specdec/model/test_kv_traffic.py guards it."""

from __future__ import annotations

import contextlib
import os
import random
import sys

import numpy as np
import torch

from specdec.model.batch import ancestor_bits, signed64
from specdec.model.native import PAGE_SIZE

SESSIONS = (1, 8, 32)
NODES = (0, 8, 32, 64)


@contextlib.contextmanager
def recorded():
    """Every (addresses, bytes per element) the interpreter loads and stores in the block: two lists."""
    from triton.runtime import interpreter

    loads: list[tuple[np.ndarray, int]] = []
    stores: list[tuple[np.ndarray, int]] = []
    b = interpreter.InterpreterBuilder
    load, store = b.create_masked_load, b.create_masked_store

    def counted_load(self, ptrs, mask, *args):
        loads.append((ptrs.data[mask.data.astype(bool)].ravel(), ptrs.get_element_ty().primitive_bitwidth // 8))
        return load(self, ptrs, mask, *args)

    def counted_store(self, ptrs, value, mask, *args):
        stores.append((ptrs.data[mask.data.astype(bool)].ravel(), ptrs.get_element_ty().primitive_bitwidth // 8))
        return store(self, ptrs, value, mask, *args)

    b.create_masked_load, b.create_masked_store = counted_load, counted_store
    try:
        yield loads, stores
    finally:
        b.create_masked_load, b.create_masked_store = load, store


def _within(addrs: np.ndarray, t: torch.Tensor) -> np.ndarray:
    lo = t.data_ptr()
    return (addrs >= lo) & (addrs < lo + t.numel() * t.element_size())


def draft_tree(nodes: int) -> list[int]:
    """A draft-shaped tree of ``nodes`` (parents, seeded): each node's parent one of the six nodes before it (or the
    root), so a few branches grow side by side, ~12 deep at 64 nodes."""
    rng = random.Random(nodes)
    return [rng.randint(max(-1, j - 6), j - 1) for j in range(nodes)]


def batch(sessions: int, nodes: int, prefix: int):
    """Each session: ``prefix`` keys, a root row and a ``nodes``-node draft tree behind it, on its own pages.
    -> (block-table rows, (session, row_len, bits) rows, the floor in keys: each session's distinct keys)."""
    tables, rows = [], []
    bits = [signed64(b) for b in ancestor_bits(draft_tree(nodes))]
    pages = -(-(prefix + 1 + nodes) // PAGE_SIZE)
    for s in range(sessions):
        tables.append(list(range(s * pages, (s + 1) * pages)))
        rows += [(s, prefix + 1, 0)] + [(s, prefix + 1, b) for b in bits]
    return tables, rows, sessions * (prefix + 1 + nodes)


def traffic(sessions: int, nodes: int, prefix: int = 63, heads: int = 4, kv_heads: int = 1, head_dim: int = 16,
            block_m: int | None = None, dtype=torch.bfloat16, attend=None) -> dict:
    """One tree attention over ``sessions`` x ``nodes``, its bytes over the floor: ``loads`` (K and V bytes
    loaded), ``unique`` (distinct K and V bytes), ``prefix`` (K and V bytes of the keys below the trees, which every
    row of a session sees, over their floor: the reads per session), ``tree`` (of the trees' keys over theirs: each
    row reads its own ancestors), ``partials`` (float32 bytes written for the merge). ``attend(q, k, v, plan,
    scale)``: the attention (the CUDA kernel's :func:`~specdec.model.cuda.kernels.tree_attention` by default)."""
    from specdec.model.cuda import kernels
    from specdec.model.cuda.plan import BLOCK_M, DevicePlan
    from tests.specdec.model.test_attention import _plan

    tables, rows, floor_keys = batch(sessions, nodes, prefix)
    plan = DevicePlan.of(_plan(tables, rows), "cpu", heads, kv_heads, block_m or BLOCK_M)
    n_pages = max(max(t) for t in tables) + 1
    g = torch.Generator().manual_seed(0)
    k = torch.randn(n_pages, kv_heads, head_dim, PAGE_SIZE, generator=g).to(dtype)
    v = torch.randn(n_pages, kv_heads, PAGE_SIZE, head_dim, generator=g).to(dtype)
    q = torch.randn(len(rows), heads, head_dim, generator=g).to(dtype)
    with recorded() as (loads, stores):
        (attend or kernels.tree_attention)(q, k, v, plan, head_dim ** -0.5)
    key_bytes = kv_heads * head_dim * 2 * k.element_size()  # K and V of one key
    floor = floor_keys * key_bytes
    # each pool element's logical position in its session: page -> (its place in the block table) * PS + offset
    logical_page = np.zeros(n_pages, dtype=np.int64)
    for t in tables:
        logical_page[t] = np.arange(len(t))
    es = k.element_size()
    total = unique = below = 0
    seen = []
    for a, size in loads:
        for pool, off_of in ((k, lambda i: i % PAGE_SIZE), (v, lambda i: (i // head_dim) % PAGE_SIZE)):
            x = a[_within(a, pool)]
            if not len(x):
                continue
            i = (x - pool.data_ptr()) // es
            pos = logical_page[i // (kv_heads * head_dim * PAGE_SIZE)] * PAGE_SIZE + off_of(i)
            total += len(x) * size
            below += int((pos <= prefix).sum()) * size  # the prefix and the root: positions 0..prefix
            seen.append(x)
    unique = len(np.unique(np.concatenate(seen))) * es if seen else 0
    partial = sum(len(a) * size for a, size in stores if size == 4)  # float32: pacc, m, l (the output is bf16)
    prefix_floor = sessions * (prefix + 1) * key_bytes
    tree_floor = sessions * nodes * key_bytes
    return {"loads": total / floor, "unique": unique / floor, "prefix": below / prefix_floor,
            "tree": (total - below) / tree_floor if nodes else 0.0, "partials": partial / floor}


def table(prefix: int = 63, sessions=SESSIONS, nodes=NODES, **kw) -> str:
    lines = ["| sessions x nodes | K+V loaded / floor | unique / floor | prefix reads per session | tree keys loaded / "
             "tree keys | partials written / floor |", "|---|---|---|---|---|---|"]
    for s in sessions:
        for n in nodes:
            t = traffic(s, n, prefix, **kw)
            lines.append(f"| {s} x {n} | {t['loads']:.3f} | {t['unique']:.3f} | {t['prefix']:.3f} | {t['tree']:.2f} "
                         f"| {t['partials']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from tests.specdec.model.interpreted import _interpreter_fixes

    _interpreter_fixes()
    args = {k: int(v) for k, v in (a.split("=") for a in sys.argv[1:])}
    sessions = (args.pop("sessions"),) if "sessions" in args else SESSIONS
    print(table(sessions=sessions, **args))
