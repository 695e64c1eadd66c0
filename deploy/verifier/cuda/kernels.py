"""Triton kernels of the batch-invariant CUDA path: tree attention over the paged pool, RMSNorm
with the residual add before it, and (for fewer launches; row-wise, so invariant by nature)
RoPE with the K/V write into the pool, and SwiGLU.

Each program owns one row (attention: one row and one query head) and reduces it in an
order fixed by the row alone: attention walks the row's logical KV sequence (its prefix,
then its tree ancestors and itself; :mod:`deploy.verifier.attention`) in blocks of
:data:`KEY_BLOCK` keys with an online softmax (FlashAttention's recurrence, Dao et al. 2022,
one query row per program); RMSNorm sums one row's squares in one block. No block size,
warp count or split depends on the batch, so a row's result is bit-identical whatever rows
share the launch (``tests/verifier/test_cuda.py``). Imported only where Triton runs
(:func:`deploy.verifier.cuda.available`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deploy.verifier.native import PAGE_SIZE

KEY_BLOCK = 32  # keys per step of a row's walk
NUM_WARPS = 4  # fixed: the layout of a block (hence the order of its sums) must not vary


@triton.jit
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, pos_ptr, len_ptr, out_ptr,
                           bt_stride, pos_stride, group, scale,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           PS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kvh = h // group
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + (row * HQ + h) * D + d, mask=dm, other=0.0).to(tl.float32)  # [BLOCK_D]
    seq = tl.load(seq_ptr + row).to(tl.int64)
    n = tl.load(len_ptr + row)  # the row's logical length: prefix + its tree ancestors and itself
    m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)  # running max (a scalar)
    l_i = tl.sum(tl.zeros([BLOCK], tl.float32), 0)  # running softmax denominator
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)  # logical indices of this block of keys
        im = i < n
        phys = tl.load(pos_ptr + row * pos_stride + i, mask=im, other=0)  # their positions in the session
        page = tl.load(bt_ptr + seq * bt_stride + phys // PS, mask=im, other=0).to(tl.int64)
        off = phys % PS
        kd = im[:, None] & dm[None, :]
        k = tl.load(k_ptr + (page * HKV + kvh)[:, None] * (D * PS) + d[None, :] * PS + off[:, None],
                    mask=kd, other=0.0).to(tl.float32)  # [BLOCK, BLOCK_D]; K pages are [Hkv, D, PS]
        s = tl.where(im, tl.sum(k * q[None, :], 1) * scale, float("-inf"))  # [BLOCK]
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(v_ptr + (page * HKV + kvh)[:, None] * (PS * D) + off[:, None] * D + d[None, :],
                    mask=kd, other=0.0).to(tl.float32)  # [BLOCK, BLOCK_D]; V pages are [Hkv, PS, D]
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(out_ptr + (row * HQ + h) * D + d, (acc / l_i).to(out_ptr.dtype.element_ty), mask=dm)


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


def tree_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan, scale: float) -> torch.Tensor:
    """q: [N, Hq, D]; k_pages: [pages, Hkv, D, PS]; v_pages: [pages, Hkv, PS, D] -> [N, Hq, D] (q's
    dtype, rounded once from the float32 sums)."""
    N, Hq, D = q.shape
    Hkv = k_pages.shape[1]
    positions, lengths = plan.logical_positions()  # [N, S] int64, [N] int32
    q = q.contiguous()
    out = torch.empty_like(q)
    if N == 0:
        return out
    bt = plan.block_table
    _tree_attention_kernel[(N, Hq)](
        q, k_pages, v_pages, bt, plan.row_seq, positions, lengths, out, bt.shape[1], positions.shape[1],
        Hq // Hkv, scale, HQ=Hq, HKV=Hkv, D=D, BLOCK_D=triton.next_power_of_2(D), PS=PAGE_SIZE, BLOCK=KEY_BLOCK,
        num_warps=NUM_WARPS)
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
