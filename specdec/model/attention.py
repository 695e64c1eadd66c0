"""Tree attention over the paged KV pool (SpecInfer-style tree masks; docs/protocol.md, step 4): a row attends
``[0, row_len)`` and ``row_len + j`` per set bit ``j`` of ``row_bits`` (int64: up to 64 nodes). docs/specdec.md."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.model import cuda, native
from specdec.model.cuda.plan import BLOCK_M, DevicePlan, device_tiles
from specdec.model.native import PAGE_SIZE


@dataclass
class AttentionPlan:
    """Where each packed query row reads its keys (built once per forward)."""

    block_table: torch.Tensor  # [B, max_pages] int32: pool page of each session's logical page
    row_seq: torch.Tensor  # [N] int32: the row's session (row of block_table)
    row_len: torch.Tensor  # [N] int32: contiguous logical positions [0, row_len) seen by the row
    row_bits: torch.Tensor  # [N] int64: tree positions row_len + j seen by the row (bit j)
    max_len: int  # the longest logical sequence of any row

    def to(self, device) -> "AttentionPlan":
        return AttentionPlan(self.block_table.to(device), self.row_seq.to(device), self.row_len.to(device),
                             self.row_bits.to(device), self.max_len)


KERNEL_MAX_HEADS_PER_KV = 8  # MAXREP in the source
KERNEL_MAX_HEAD_DIM = 256


BACKENDS = ("triton", "sdpa")  # verifier.attention_backend (deploy/config.py)


def select_backend(device: torch.device, dtype: torch.dtype, heads: int = 1, kv_heads: int = 1, head_dim: int = 64,
                   requested: str = "triton") -> tuple[bool, str | None]:
    """(whether a kernel runs the tree attention, why not where one was asked for on CUDA and cannot run).
    ``requested``: "triton", the kernels (Triton's on CUDA, the C one on CPU) where they run; "sdpa": torch's
    scaled_dot_product_attention over the gathered pages with the tree mask (:func:`torch_attention`), anywhere."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r}: one of {', '.join(BACKENDS)}")
    if requested == "sdpa":
        return False, None
    device = torch.device(device)
    if device.type == "cuda":
        why = cuda.why_not(device)
        if why is None and not (heads % kv_heads == 0 and heads // kv_heads <= BLOCK_M
                                and head_dim <= KERNEL_MAX_HEAD_DIM):
            why = f"head layout {heads}/{kv_heads} x {head_dim} is beyond the Triton kernel's tile"
        return why is None, why
    shape_ok = (heads % kv_heads == 0 and heads // kv_heads <= KERNEL_MAX_HEADS_PER_KV and head_dim % 4 == 0
                and head_dim <= KERNEL_MAX_HEAD_DIM)
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and shape_ok
            and native.load() is not None), None


def use_kernel(device: torch.device, dtype: torch.dtype, heads: int = 1, kv_heads: int = 1,
               head_dim: int = 64) -> bool:
    """Whether a kernel runs this: Triton's on CUDA (a supported card), the C kernel on the CPU (bf16/fp32, a head
    layout it handles)."""
    return select_backend(device, dtype, heads, kv_heads, head_dim)[0]


def tree_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: AttentionPlan | DevicePlan,
                   scale: float, kernel: bool | None = None) -> torch.Tensor:
    """q: [N, Hq, D]; k_pages: [pages, Hkv, D, PS]; v_pages: [pages, Hkv, PS, D] -> [N, Hq, D] (q's dtype).
    A :class:`DevicePlan` only for the CUDA kernel."""
    if kernel is None:
        kernel = use_kernel(q.device, q.dtype, q.shape[1], k_pages.shape[1], q.shape[2])
    if not kernel:
        return torch_attention(q, k_pages, v_pages, plan, scale)
    if q.device.type == "cuda":
        from specdec.model.cuda import kernels

        if isinstance(plan, AttentionPlan):  # a forward builds its DevicePlan once for every layer
            plan = DevicePlan.of(plan, q.device, q.shape[1], k_pages.shape[1],
                                 device_tiles(q.device, q.shape[2]).block_m)
        return kernels.tree_attention(q, k_pages, v_pages, plan, scale)
    lib = native.load()
    N, Hq, D = q.shape
    Hkv = k_pages.shape[1]
    q = q.contiguous()
    out = torch.empty(N, Hq, D, dtype=torch.float32)
    fn = lib.tree_attention_bf16 if q.dtype == torch.bfloat16 else lib.tree_attention_f32
    bt = plan.block_table
    err = fn(q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), bt.data_ptr(), bt.shape[1],
             plan.row_seq.data_ptr(), plan.row_len.data_ptr(), plan.row_bits.data_ptr(), out.data_ptr(),
             N, Hq, Hkv, D, ctypes.c_float(scale), plan.max_len, torch.get_num_threads())
    if err == 2:
        raise ValueError(f"tree attention kernel: unsupported heads {Hq}/{Hkv} x {D} (see use_kernel)")
    if err:
        raise MemoryError("tree attention: scratch allocation failed")
    return out.to(q.dtype)


def row_positions(plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logical positions, left-aligned: positions [N, S] long, valid [N, S] bool."""
    lens = plan.row_len.long()
    bits = plan.row_bits
    j = torch.arange(64, device=bits.device)
    set_ = ((bits[:, None] >> j) & 1).bool()  # [N, 64]
    n_extra = set_.sum(1)
    S = int((lens + n_extra).max())
    ar = torch.arange(S, device=bits.device)
    pos = ar.expand(len(lens), S).clone()  # [N, S]
    # the k-th set bit lands at column len + k with position len + j
    rank = set_.long().cumsum(1) - 1  # [N, 64]
    rows, cols = set_.nonzero(as_tuple=True)
    pos[rows, lens[rows] + rank[rows, cols]] = lens[rows] + cols
    valid = ar[None, :] < (lens + n_extra)[:, None]
    return pos.masked_fill(~valid, 0), valid


def torch_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: AttentionPlan,
                    scale: float) -> torch.Tensor:
    """Reference implementation: gather each row's keys [N, S, Hkv, D], masked SDPA with GQA."""
    pos, valid = row_positions(plan)
    pages = plan.block_table.long()[plan.row_seq.long()[:, None], pos // PAGE_SIZE]  # [N, S]
    off = pos % PAGE_SIZE
    k = k_pages[pages, :, :, off]  # [N, S, Hkv, D]
    v = v_pages[pages, :, off, :]  # [N, S, Hkv, D]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),  # [N, H, 1, D], [N, Hkv, S, D]
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
    return out.squeeze(2)
