"""CUDA graphs of the layer stack: a forward as one replay instead of hundreds of launches (as vLLM, gpt-fast).
``N`` rows replay in the smallest bucket ``>= N`` (:data:`ROW_BUCKETS`), bit-equal to eager; docs/gpu_attention.md."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from specdec.errors import KVCapacityExceeded
from specdec.model.cuda.plan import (DevicePlan, device_tiles, logical_lengths, num_chunks, rows_per_tile,
                                     session_tiles)
from specdec.model.native import PAGE_SIZE

# powers of two to 128 rows, then multiples of 128: the GEMMs run in 128-row chunks anyway
# (row_chunks.py), so above 128 a bucket adds no GEMM work to the eager forward's
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128) + tuple(range(256, 1025, 128))
MIN_WIDTH = 64  # logical keys per row, at least (a power of two)
MIN_PAGES = 4  # block table entries per session, at least (a power of two)
MAX_INTS = 1 << 22  # a graph's int inputs, at most (32 MiB): a larger forward runs eagerly
_ROW_FIELDS = ("ids", "rope_pos", "page", "off", "seq", "row_len", "bits")  # one int per row each
# one capture at a time in the process: a capture begins with a device-wide synchronize, which
# fails while another thread's stream is capturing (an edge agent's drafter and an in-process
# engine capture on their own threads)
_CAPTURE_LOCK = threading.Lock()


def bucket_rows(n: int) -> int | None:
    """The smallest row bucket holding ``n`` rows (None: more than the largest)."""
    return next((b for b in ROW_BUCKETS if b >= n), None)


def pow2_at_least(n: int, floor: int) -> int:
    """The smallest power of two >= max(n, floor)."""
    return 1 << (max(n, floor) - 1).bit_length()


@dataclass(frozen=True)
class GraphShape:
    rows: int  # a row bucket
    tiles: int  # attention tiles (a power of two; never more than the rows)
    rows_per_tile: int  # of the model's head layout (cuda.plan.rows_per_tile)
    width: int  # logical keys per row, at most: sets the attention's chunk count
    pages: int  # block table entries per session

    @classmethod
    def of(cls, num_rows: int, num_tiles: int, rows_per_tile: int, max_len: int,
           table_pages: int) -> "GraphShape | None":
        """The graph a forward of ``num_rows`` rows in ``num_tiles`` tiles runs in (None: eagerly)."""
        rows = bucket_rows(num_rows)
        if rows is None:
            return None
        shape = cls(rows, min(pow2_at_least(num_tiles, 1), rows), rows_per_tile, pow2_at_least(max_len, MIN_WIDTH),
                    pow2_at_least(table_pages, MIN_PAGES))
        return shape if shape.num_ints <= MAX_INTS else None

    @property
    def num_ints(self) -> int:
        return self.rows * (len(_ROW_FIELDS) + self.pages) + self.tiles * self.rows_per_tile

    @property
    def chunks(self) -> int:
        return num_chunks(self.width)

    def fields(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of an int64 buffer [num_ints]: one [rows] per row field, then the attention tiles
        [tiles, rows_per_tile], then the block table [rows, pages] (a session per row at most)."""
        r, out, at = self.rows, {}, 0
        for name in _ROW_FIELDS:
            out[name], at = buf[at: at + r], at + r
        n = self.tiles * self.rows_per_tile
        out["tiles"], at = buf[at: at + n].view(self.tiles, self.rows_per_tile), at + n
        out["bt"] = buf[at: at + r * self.pages].view(r, self.pages)
        return out

    def plan(self, f: dict[str, torch.Tensor]) -> DevicePlan:
        """The attention plan of a graph's input views (their logical lengths computed on the device)."""
        return DevicePlan(f["bt"], f["seq"], f["row_len"], f["bits"], logical_lengths(f["row_len"], f["bits"]),
                          f["tiles"], self.chunks)


def fill_inputs(f: dict[str, torch.Tensor], batch, tiles: torch.Tensor, scratch_slot: int) -> int:
    """Write ``batch`` (N rows, its plan on the host; ``tiles``: its attention tiles) into a graph's host input
    views ``f``, padding after it; returns how many leading ints hold them (the rest is stale, unread)."""
    N, plan = batch.num_tokens, batch.plan
    f["ids"][:N], f["ids"][N:] = batch.input_ids, 0
    f["rope_pos"][:N], f["rope_pos"][N:] = batch.positions, 0
    f["page"][:N], f["page"][N:] = batch.slots // PAGE_SIZE, scratch_slot // PAGE_SIZE
    f["off"][:N], f["off"][N:] = batch.slots % PAGE_SIZE, scratch_slot % PAGE_SIZE
    f["seq"][:N], f["seq"][N:] = plan.row_seq, 0
    f["row_len"][:N], f["row_len"][N:] = plan.row_len, 0  # padding rows are in no tile: never read
    f["bits"][:N], f["bits"][N:] = plan.row_bits, 0
    f["tiles"][: len(tiles)], f["tiles"][len(tiles):] = tiles, -1
    bt = plan.block_table  # [B, P]: entries past it are never read (no row reaches them)
    f["bt"][: bt.shape[0], : bt.shape[1]] = bt
    return f["bt"].storage_offset() - f["ids"].storage_offset() + bt.shape[0] * f["bt"].shape[1]


@dataclass(eq=False)
class _Graph:
    """One captured stack for one :class:`GraphShape`: its static inputs and output."""

    shape: GraphShape
    host: torch.Tensor  # [num_ints] int64, pinned
    dev: torch.Tensor  # [num_ints] int64 on the GPU: what the graph reads
    hidden: torch.Tensor | None  # [rows, D] the incoming stream of a later pipeline stage
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # [rows, D]: the stream after the last layer
    copied: torch.cuda.Event | None = None  # the last host-to-device copy (host reusable after it)
    host_fields: dict[str, torch.Tensor] = field(init=False)  # views of host / dev, made once
    dev_fields: dict[str, torch.Tensor] = field(init=False)

    def __post_init__(self):
        self.host_fields, self.dev_fields = self.shape.fields(self.host), self.shape.fields(self.dev)


@dataclass(eq=False)
class _PoolGraphs:
    scratch_slot: int
    graphs: dict[GraphShape, _Graph] = field(default_factory=dict)


class LayerGraphs:
    """The CUDA graphs of one DecoderModel's layer stack, per KV pool and :class:`GraphShape`, captured on first use."""

    def __init__(self, model):
        self.model = model
        self.mempool = torch.cuda.graph_pool_handle()  # graphs replay one at a time: one memory pool
        self._pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.captures = 0

    def __call__(self, batch, pool, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """The stream after the layers [N, D] for ``batch`` (its plan on the host), or None: run it eagerly."""
        s = self.model.spec
        block_m = device_tiles(self.model.device, s.head_dim).block_m  # the card's (cuda.plan.card_tiles)
        rows_per = rows_per_tile(s.num_heads, s.num_kv_heads, block_m)
        tiles = session_tiles(batch.plan.row_seq, rows_per)  # [T, rows_per]
        shape = GraphShape.of(batch.num_tokens, len(tiles), rows_per, batch.plan.max_len,
                              batch.plan.block_table.shape[1])
        if shape is None:
            return None
        state = self._pools.get(pool)
        if state is None:
            try:
                state = self._pools[pool] = _PoolGraphs(pool.scratch_slot())
            except KVCapacityExceeded:
                return None
        g = state.graphs.get(shape)
        if g is None:
            g = state.graphs[shape] = self._new(shape)
        self._copy_in(g, batch, tiles, state.scratch_slot)
        N = batch.num_tokens
        if g.hidden is not None:
            g.hidden[:N].copy_(hidden)
        if g.graph is None:
            self._capture(g, pool)
        g.graph.replay()
        return g.out[:N].clone()  # the next replay overwrites out

    def _new(self, shape: GraphShape) -> _Graph:
        m = self.model
        hidden = None if m.is_first else torch.zeros(shape.rows, m.spec.hidden_size, dtype=m.dtype, device=m.device)
        return _Graph(shape, torch.zeros(shape.num_ints, dtype=torch.long, pin_memory=True),
                      torch.zeros(shape.num_ints, dtype=torch.long, device=m.device), hidden)

    @staticmethod
    def _copy_in(g: _Graph, batch, tiles: torch.Tensor, scratch_slot: int) -> None:
        """The batch into the graph's inputs: filled on the host, one asynchronous copy."""
        if g.copied is not None:
            g.copied.synchronize()  # the last copy has read the pinned buffer
        used = fill_inputs(g.host_fields, batch, tiles, scratch_slot)
        g.dev[:used].copy_(g.host[:used], non_blocking=True)
        g.copied = torch.cuda.Event()
        g.copied.record()

    def _stack(self, g: _Graph, pool) -> torch.Tensor:
        """What a replay runs: embedding (or the incoming stream), RoPE tables, the layers."""
        m, f = self.model, g.dev_fields
        h = m.embed_rows(f["ids"], g.hidden)
        cos, sin = m._rope(f["rope_pos"])
        return m.run_layers(h, cos, sin, pool, (f["page"], f["off"]), g.shape.plan(f))

    def _capture(self, g: _Graph, pool) -> None:
        """Run the stack once on a side stream (compiles, sets up cuBLAS: nothing a capture may do), then capture it."""
        device = self.model.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._stack(g, pool)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with _CAPTURE_LOCK, torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            g.out = self._stack(g, pool)
        g.graph = graph
        self.captures += 1
