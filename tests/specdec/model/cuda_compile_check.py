"""Compiles the CUDA tree attention for Hopper (sm_90) with Triton's own ptxas, no GPU needed, and
prints what the compiled kernel holds (registers, local-memory stack, shared memory, its PTX
instructions): ``python -m tests.specdec.model.cuda_compile_check DTYPE HEADS KV_HEADS HEAD_DIM``.
Run in a process without ``TRITON_INTERPRET`` (tests/specdec/model/test_cuda_compile.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specdec.model.cuda import kernels

POINTERS = 13  # the kernel's pointer arguments come first; a launch specialises them as 16-byte aligned


def compile_attention(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, index_dtype: str = "i32"):
    meta = kernels.attention_meta(dtype, heads, kv_heads, head_dim)
    warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
    t = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    signature = {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "bt_ptr": f"*{index_dtype}",
                 "seq_ptr": f"*{index_dtype}", "len_ptr": f"*{index_dtype}", "bits_ptr": "*i64", "n_ptr": "*i32",
                 "tiles_ptr": f"*{index_dtype}", "out_ptr": f"*{t}", "pacc_ptr": "*fp32", "pm_ptr": "*fp32",
                 "pl_ptr": "*fp32", "bt_stride": "i32", "nch": "i32", "qk_scale": "fp32", **{k: "constexpr" for k in meta}}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(POINTERS)}
    return triton.compile(ASTSource(kernels._tree_attention_kernel, signature, meta, aligned),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def resources(compiled) -> dict:
    """Registers, stack (local memory: spills) and shared memory of a compiled kernel, and its PTX opcodes."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    ops = sorted(set(re.findall(r"\b(wgmma\.mma_async|mma\.sync|cp\.async|ld\.global\.v4|ld\.local|st\.local)",
                                compiled.asm["ptx"])))
    return {"registers": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": compiled.metadata.shared,
            "ops": ops}


if __name__ == "__main__":
    dtype, heads, kv_heads, head_dim = sys.argv[1:5]
    print(json.dumps(resources(compile_attention(getattr(torch, dtype), int(heads), int(kv_heads), int(head_dim)))))
