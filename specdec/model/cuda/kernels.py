"""Triton kernels of the batch-invariant CUDA path: tree attention over the paged pool, RMSNorm with the residual add
before it, and (row-wise, for fewer launches) RoPE with the K/V write into the pool, and SwiGLU. Attention: SpecInfer's
tree mask, FlashAttention's online softmax (Dao et al. 2022), flash-decoding's split KV; docs/gpu_attention.md."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from specdec.model.cuda.plan import CHUNK, DevicePlan, Tiles, device_tiles, group_width, rows_per_tile
from specdec.model.native import PAGE_SIZE

BLOCK_N = PAGE_SIZE  # keys per step of a tile's walk: one page, so a block is contiguous in the pool
assert CHUNK % BLOCK_N == 0
NUM_WARPS = 4  # fixed: the layout of a block (hence the order of its sums) must not vary
NUM_STAGES = 2
LOG2E = 1.4426950408889634  # the softmax runs in base 2: exp(x) = exp2(x log2 e)


@triton.jit
def _tree_nodes(i, bits):
    """Each tree lane ``i`` [BLOCK_N]'s node: the i-th set bit of ``bits``; 0 where ``i`` is out of range (masked)."""
    j = tl.arange(0, 64)
    setb = ((bits >> j) & 1).to(tl.int32)  # [64]
    rank = tl.cumsum(setb, 0) - setb  # [64] set bits below j
    hit = (setb[None, :] == 1) & (rank[None, :] == i[:, None])  # [BLOCK_N, 64]
    return tl.sum(tl.where(hit, j[None, :], 0), 1)


@triton.jit
def _slot_value(x, one):
    """The entry of ``x`` [BLOCK_M] where ``one`` holds (exactly one lane): a register reduction."""
    return tl.sum(tl.where(one, x, 0), 0)


@triton.jit
def _softmax_step(s, b0, n, m_i, l_i, qk_scale, BLOCK_N: tl.constexpr):
    """One key block of the online softmax (log2 domain): raw scores s [BLOCK_M, BLOCK_N] of keys b0.. for rows of
    logical length n [BLOCK_M] -> (p, alpha, m, l); a row with no key here (b0 >= n) keeps its state exactly."""
    valid = (b0 + tl.arange(0, BLOCK_N))[None, :] < n[:, None]
    s = tl.where(valid, s * qk_scale, float("-inf"))
    active = b0 < n
    m_new = tl.where(active, tl.maximum(m_i, tl.max(s, 1)), m_i)
    m_sub = tl.where(active, m_new, 0.0)  # finite: no inf - inf in the rows left as they are
    alpha = tl.where(active, tl.exp2(m_i - m_sub), 1.0)
    p = tl.where(valid, tl.exp2(s - m_sub[:, None]), 0.0)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _page_block(k_ptr, v_ptr, table_ptr, b0, kvh, d, dm, lanes, v_valid, HKV: tl.constexpr, D: tl.constexpr,
                PS: tl.constexpr):
    """The key block at logical position b0 of a session (``table_ptr``: its block-table row), KV head ``kvh``: one
    page's keys [BLOCK_D, PS] and values [PS, BLOCK_D], values zero where ``v_valid`` [PS] is false."""
    head = tl.load(table_ptr + b0 // PS).to(tl.int64) * HKV + kvh
    kt = tl.load(k_ptr + head * (D * PS) + d[:, None] * PS + lanes[None, :], mask=dm[:, None], other=0.0)
    v = tl.load(v_ptr + head * (PS * D) + lanes[:, None] * D + d[None, :], mask=v_valid[:, None] & dm[None, :],
                other=0.0)
    return kt, v


@triton.jit
def _block_step(q, kt, v, b0, n, m_i, l_i, acc, qk_scale, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """One key block for a tile: q [BLOCK_M, BLOCK_D], keys kt [BLOCK_D, BLOCK_N], v [BLOCK_N, BLOCK_D] at b0.."""
    p, alpha, m_i, l_i = _softmax_step(tl.dot(q, kt, input_precision=PREC), b0, n, m_i, l_i, qk_scale, BLOCK_N)
    return m_i, l_i, tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)


@triton.jit
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, len_ptr, bits_ptr, n_ptr, tiles_ptr, out_ptr,
                           pacc_ptr, pm_ptr, pl_ptr, bt_stride, nch, qk_scale,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           PS: tl.constexpr, GP: tl.constexpr, RPT: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PREC: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    c0 = tl.program_id(2) * CHUNK
    m = tl.arange(0, BLOCK_M)
    slot = m // GP  # [BLOCK_M] the row of the tile, then the query head of its group
    g = m % GP
    row = tl.load(tiles_ptr + t * RPT + slot)
    live = (row >= 0) & (g < HQ // HKV)
    row = tl.where(row >= 0, row, 0).to(tl.int64)
    n = tl.where(live, tl.load(n_ptr + row), 0)  # [BLOCK_M] logical lengths
    n_max = tl.max(n, 0)
    if c0 < n_max:
        rlen = tl.load(len_ptr + row).to(tl.int32)
        bits = tl.load(bits_ptr + row).to(tl.int64)
        seq = tl.load(seq_ptr + tl.load(tiles_ptr + t * RPT)).to(tl.int64)
        # keys below tree_start are the same session positions for every row: one key block for the tile
        tree_start = tl.min(tl.where(live & (bits != 0), rlen, 1 << 30), 0)
        c_end = tl.minimum(c0 + CHUNK, n_max)
        u_end = tl.maximum(tl.minimum(tree_start // BLOCK_N * BLOCK_N, c_end), c0)
        h = kvh * (HQ // HKV) + g
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(q_ptr + (row * HQ + h)[:, None] * D + d[None, :], mask=live[:, None] & dm[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lanes = tl.arange(0, BLOCK_N)
        for b0 in range(c0, u_end, BLOCK_N):  # shared key blocks: K/V read once for the whole tile
            kt, v = _page_block(k_ptr, v_ptr, bt_ptr + seq * bt_stride, b0, kvh, d, dm, lanes, (b0 + lanes) < n_max,
                                HKV, D, PS)
            m_i, l_i, acc = _block_step(q, kt, v, b0, n, m_i, l_i, acc, qk_scale, BLOCK_N, PREC)
        # blocks reaching into the trees: row by row, each its own keys (its ancestors) through the same
        # tile shape, the other rows' state left exactly as it is (their n masked to 0)
        for r in range(0, RPT):
            one = (slot == r) & (g == 0)
            nr = _slot_value(n, one)
            rl = _slot_value(rlen, one)
            rbits = _slot_value(bits, one)
            n_r = tl.where(slot == r, n, 0)
            for b0 in range(u_end, tl.minimum(c_end, nr), BLOCK_N):
                lane = b0 + lanes
                tree = (lane >= rl) & (lane < nr)
                node = _tree_nodes(lane - rl, rbits)  # node j sits at tree_start + j (batch.tree_input)
                # one load per lane: a tree lane's node (its own page and offset), else the block's own page
                page_head = tl.load(bt_ptr + seq * bt_stride + b0 // PS).to(tl.int64) * HKV + kvh
                node_page = tl.load(bt_ptr + seq * bt_stride + (tree_start + node) // PS, mask=tree, other=0)
                head = tl.where(tree, node_page.to(tl.int64) * HKV + kvh, page_head)  # [BLOCK_N]
                off = tl.where(tree, (tree_start + node) % PS, lanes)  # b0 is a page boundary
                ok = lane < nr
                kp = k_ptr + (head * (D * PS) + off)  # [BLOCK_N] each lane's key, then its dims (int32 offsets)
                vp = v_ptr + (head * PS + off) * D
                kt = tl.load(kp[None, :] + (d * PS)[:, None], mask=dm[:, None] & ok[None, :], other=0.0)
                v = tl.load(vp[:, None] + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
                m_i, l_i, acc = _block_step(q, kt, v, b0, n_r, m_i, l_i, acc, qk_scale, BLOCK_N, PREC)
        # a row within one chunk is final here; a longer row leaves this chunk's partial for the merge
        whole = tl.cdiv(n, CHUNK) == 1
        od = (row * HQ + h)[:, None] * D + d[None, :]
        tl.store(out_ptr + od, (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty),
                 mask=(live & whole & (c0 == 0))[:, None] & dm[None, :])
        part = live & ~whole & (c0 < n)
        pidx = (row * HQ + h) * nch + c0 // CHUNK
        tl.store(pacc_ptr + pidx[:, None] * BLOCK_D + d[None, :], acc, mask=part[:, None] & dm[None, :])
        tl.store(pm_ptr + pidx, m_i, mask=part)
        tl.store(pl_ptr + pidx, l_i, mask=part)


@triton.jit
def _merge_chunks_kernel(pacc_ptr, pm_ptr, pl_ptr, n_ptr, out_ptr, nch,
                         HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """A row longer than one chunk: its chunks' partials folded in ascending order."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    k = tl.cdiv(tl.load(n_ptr + row), CHUNK)
    if k > 1:
        d = tl.arange(0, BLOCK_D)
        base = (row * HQ + h) * nch
        m_i = tl.load(pm_ptr + base)
        l_i = tl.load(pl_ptr + base)
        acc = tl.load(pacc_ptr + base * BLOCK_D + d)
        for c in range(1, k):
            m_c = tl.load(pm_ptr + base + c)
            m_new = tl.maximum(m_i, m_c)
            a = tl.exp2(m_i - m_new)
            b = tl.exp2(m_c - m_new)
            l_i = l_i * a + tl.load(pl_ptr + base + c) * b
            acc = acc * a + tl.load(pacc_ptr + (base + c) * BLOCK_D + d) * b
            m_i = m_new
        tl.store(out_ptr + (row * HQ + h) * D + d, (acc / l_i).to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _add_rms_norm_kernel(h_ptr, delta_ptr, h_out_ptr, w_ptr, y_ptr, D, eps,
                         HAS_DELTA: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    h = tl.load(h_ptr + row * D + d, mask=dm, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the model dtype as torch's add is
        delta = tl.load(delta_ptr + row * D + d, mask=dm, other=0.0)
        h = (h.to(tl.float32) + delta.to(tl.float32)).to(h_out_ptr.dtype.element_ty)
        tl.store(h_out_ptr + row * D + d, h, mask=dm)
    x = h.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=dm, other=0.0)
    xn = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)  # HF: normalise in float32, scale in the model dtype
    tl.store(y_ptr + row * D + d, (w.to(tl.float32) * xn).to(y_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, page_ptr, off_ptr,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       PS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # a head of qkv: Hq query heads, then Hkv keys, then Hkv values
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    x = tl.load(qkv_ptr + (row * (HQ + 2 * HKV) + j) * D + d, mask=dm, other=0.0)
    page = tl.load(page_ptr + row).to(tl.int64)
    off = tl.load(off_ptr + row)
    if j < HQ + HKV:  # RoPE: x cos + rotate_half(x) sin, each product rounded to the dtype as torch's are
        half = D // 2
        xp = tl.load(qkv_ptr + (row * (HQ + 2 * HKV) + j) * D + tl.where(d < half, d + half, d - half), mask=dm,
                     other=0.0)
        rot = tl.where(d < half, -xp.to(tl.float32), xp.to(tl.float32))  # rotate_half (negation exact)
        c = tl.load(cos_ptr + row * D + d, mask=dm, other=0.0)
        s = tl.load(sin_ptr + row * D + d, mask=dm, other=0.0)
        dt = q_ptr.dtype.element_ty
        a = (x.to(tl.float32) * c.to(tl.float32)).to(dt)
        b = (rot * s.to(tl.float32)).to(dt)
        y = (a.to(tl.float32) + b.to(tl.float32)).to(dt)
        if j < HQ:
            tl.store(q_ptr + (row * HQ + j) * D + d, y, mask=dm)
        else:  # K pages are [Hkv, D, PS]
            tl.store(k_ptr + (page * HKV + (j - HQ)) * (D * PS) + d * PS + off, y, mask=dm)
    else:  # V pages are [Hkv, PS, D]
        tl.store(v_ptr + (page * HKV + (j - HQ - HKV)) * (PS * D) + off * D + d, x, mask=dm)


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < I
    g = tl.load(gu_ptr + row * 2 * I + i, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * 2 * I + I + i, mask=m, other=0.0)
    gf = g.to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gf / (1.0 + tl.exp(-gf))).to(dt)  # silu, rounded to the dtype as torch's is
    tl.store(out_ptr + row * I + i, (act.to(tl.float32) * u.to(tl.float32)).to(dt), mask=m)


def attention_meta(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, tiles: Tiles = Tiles()) -> dict:
    """The attention kernel's compile-time arguments (constexprs, warps, stages, register cap) for a head layout,
    dtype and card class (:func:`specdec.model.cuda.plan.card_tiles`)."""
    gp = group_width(heads, kv_heads)
    meta = dict(HQ=heads, HKV=kv_heads, D=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PS=PAGE_SIZE,
                GP=gp, RPT=rows_per_tile(heads, kv_heads, tiles.block_m), BLOCK_M=tiles.block_m, BLOCK_N=BLOCK_N,
                CHUNK=CHUNK, PREC="ieee" if dtype == torch.float32 else "tf32", num_warps=tiles.warps,
                num_stages=NUM_STAGES)
    if tiles.maxnreg is not None:
        meta["maxnreg"] = tiles.maxnreg
    return meta


def tree_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: DevicePlan,
                   scale: float) -> torch.Tensor:
    """q: [N, Hq, D]; k_pages: [pages, Hkv, D, PS]; v_pages: [pages, Hkv, PS, D] -> [N, Hq, D] (q's
    dtype, rounded once from the float32 sums). Rows in no tile of ``plan`` get zeros. The tile's height is the
    plan's (built for this card: :func:`~specdec.model.cuda.plan.device_tiles`), its warps the card's."""
    N, Hq, D = q.shape
    Hkv = k_pages.shape[1]
    q = q.contiguous()
    out = torch.zeros_like(q)
    T, rpt = plan.tiles.shape
    if N == 0 or T == 0:
        return out
    tiles = dataclasses.replace(device_tiles(q.device, D), block_m=rpt * group_width(Hq, Hkv))
    meta = attention_meta(q.dtype, Hq, Hkv, D, tiles)
    nch = plan.chunks
    parts = N * Hq * nch if nch > 1 else 1
    pacc = torch.empty(parts * meta["BLOCK_D"], dtype=torch.float32, device=q.device)
    pm = torch.empty(parts, dtype=torch.float32, device=q.device)
    pl = torch.empty(parts, dtype=torch.float32, device=q.device)
    bt = plan.block_table
    _tree_attention_kernel[(T, Hkv, nch)](q, k_pages, v_pages, bt, plan.row_seq, plan.row_len, plan.row_bits,
                                          plan.lengths, plan.tiles, out, pacc, pm, pl, bt.shape[1], nch, scale * LOG2E,
                                          **meta)
    if nch > 1:
        _merge_chunks_kernel[(N, Hq)](pacc, pm, pl, plan.lengths, out, nch, HQ=Hq, D=D, BLOCK_D=meta["BLOCK_D"],
                                      CHUNK=CHUNK, num_warps=1)
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta) * w) for rows h, delta [R, D] (without ``delta``: (h, rms_norm(h) * w))."""
    h = h.contiguous()
    R, D = h.shape
    y = torch.empty_like(h)
    h_out = torch.empty_like(h) if delta is not None else h
    if R:
        _add_rms_norm_kernel[(R,)](h, delta.contiguous() if delta is not None else h, h_out, w.contiguous(), y, D,
                                   eps, HAS_DELTA=delta is not None, BLOCK_D=triton.next_power_of_2(D),
                                   num_warps=NUM_WARPS)
    return h_out, y


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, k_pages: torch.Tensor,
               v_pages: torch.Tensor, page: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """RoPE on qkv [N, Hq + 2 Hkv, d] (cos, sin [N, 1, d]); k and v written into the layer's pages
    at (page, off) [N] each; returns q [N, Hq, d]. One launch for what is ~14 torch ops."""
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    N, _, D = qkv.shape
    q = torch.empty(N, hq, D, dtype=qkv.dtype, device=qkv.device)
    if N:
        _rope_write_kernel[(N, hq + 2 * hkv)](qkv, cos, sin, q, k_pages, v_pages, page.contiguous(), off.contiguous(),
                                              HQ=hq, HKV=hkv, D=D, BLOCK_D=triton.next_power_of_2(D), PS=PAGE_SIZE,
                                              num_warps=1)
    return q


SWIGLU_BLOCK = 1024


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2 I] -> silu(gate) * up [N, I], one launch."""
    gate_up = gate_up.contiguous()
    N, two_i = gate_up.shape
    out = torch.empty(N, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    if N:
        _swiglu_kernel[(N, triton.cdiv(two_i // 2, SWIGLU_BLOCK))](gate_up, out, two_i // 2, BLOCK=SWIGLU_BLOCK,
                                                                   num_warps=NUM_WARPS)
    return out
