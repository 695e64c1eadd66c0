"""Compiles the CUDA tree attention for a card class with Triton's own ptxas, no GPU needed, and prints what the
compiled kernel holds at each head layout (registers, local-memory stack, spills, shared memory, its tensor-core and
copy instructions): ``python -m tests.specdec.model.cuda_compile_check sm_80 [sm_89 ...]`` (one JSON line per card),
or ``--table`` for the markdown table of docs/gpu_attention.md. Run in a process without ``TRITON_INTERPRET``
(tests/specdec/model/test_cuda_compile.py)."""

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
from specdec.model.cuda.plan import CARD_CLASSES, card_tiles

POINTERS = 13  # the kernel's pointer arguments come first; a launch specialises them as 16-byte aligned

# compute capability per card class (specdec.model.cuda.plan.CARD_CLASSES), and what one block may have of shared
# memory there (the opt-in maximum, CUDA C Programming Guide, "Technical Specifications per Compute Capability")
CARDS = {name: major * 10 + minor for (major, minor), name in CARD_CLASSES.items()}
KB = 1024
SHARED_LIMIT = {"sm_80": 163 * KB, "sm_86": 99 * KB, "sm_87": 163 * KB, "sm_89": 99 * KB, "sm_90": 227 * KB,
                "sm_100": 227 * KB, "sm_120": 99 * KB}
# the tensor-core instruction each card class has (and the kernel must use there)
MMA = {"sm_80": "mma.sync", "sm_86": "mma.sync", "sm_87": "mma.sync", "sm_89": "mma.sync",
       "sm_90": "wgmma.mma_async", "sm_100": "tcgen05.mma", "sm_120": "mma.sync"}
# head layouts (query heads, KV heads, head dim): the verifier's targets and the edge's drafts
LAYOUTS = {"llama-3-8b": (32, 8, 128), "qwen3-14b": (40, 8, 128), "embedded": (9, 3, 64),
           "llama-3.2-1b": (32, 8, 64), "qwen3-1.7b": (16, 8, 128)}
ROLES = {"llama-3-8b": "verifier", "qwen3-14b": "verifier", "embedded": "verifier; edge (the embedded draft)",
         "llama-3.2-1b": "edge (1B-class draft)", "qwen3-1.7b": "edge (1B-class draft of Qwen3)"}


def compile_attention(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, card: str = "sm_90",
                      index_dtype: str = "i32"):
    cc = CARDS[card]
    meta = kernels.attention_meta(dtype, heads, kv_heads, head_dim, card_tiles(divmod(cc, 10), head_dim))
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in meta}
    t = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    signature = {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "bt_ptr": f"*{index_dtype}",
                 "seq_ptr": f"*{index_dtype}", "len_ptr": f"*{index_dtype}", "bits_ptr": "*i64", "n_ptr": "*i32",
                 "tiles_ptr": f"*{index_dtype}", "out_ptr": f"*{t}", "pacc_ptr": "*fp32", "pm_ptr": "*fp32",
                 "pl_ptr": "*fp32", "bt_stride": "i32", "nch": "i32", "qk_scale": "fp32", **{k: "constexpr" for k in meta}}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(POINTERS)}
    return triton.compile(ASTSource(kernels._tree_attention_kernel, signature, meta, aligned),
                          target=GPUTarget("cuda", cc, 32), options=options)


def resources(compiled) -> dict:
    """Registers, stack (local memory: spills) and shared memory of a compiled kernel, and its PTX opcodes."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    ops = sorted(set(re.findall(r"\b(wgmma\.mma_async|tcgen05\.mma|mma\.sync|cp\.async|ld\.global\.v4)\b", ptx)))
    return {"registers": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": compiled.metadata.shared,
            "spills": bool(re.search(r"\b(ld|st)\.local\b", ptx)) or int(fields["STACK"]) > 0, "ops": ops}


def card_report(card: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Each layout's resources on ``card``, with the tile it was compiled with."""
    out = {}
    for name, (h, kv, d) in LAYOUTS.items():
        tiles = card_tiles(divmod(CARDS[card], 10), d)
        out[name] = {**resources(compile_attention(dtype, h, kv, d, card)), "block_m": tiles.block_m,
                     "warps": tiles.warps}
    return out


def table(reports: dict[str, dict]) -> str:
    """The markdown compile table: one line per card and layout."""
    lines = ["| card | layout (heads/KV x dim) | role | tile (heads x warps) | registers | spills | shared (limit) "
             "| tensor cores | async copy |", "|---|---|---|---|---|---|---|---|---|"]
    for card, rep in reports.items():
        for name, r in rep.items():
            h, kv, d = LAYOUTS[name]
            lines.append(f"| {card} | {name} ({h}/{kv} x {d}) | {ROLES[name]} | {r['block_m']} x {r['warps']} "
                         f"| {r['registers']} | {r['stack'] if r['spills'] else 'none'} "
                         f"| {r['shared'] / KB:.0f} KB ({SHARED_LIMIT[card] // KB} KB) "
                         f"| {MMA[card] if MMA[card] in r['ops'] else 'NONE'} "
                         f"| {'cp.async' if 'cp.async' in r['ops'] else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--table":
        print(table({card: card_report(card) for card in (args[1:] or CARDS)}))
    else:
        for card in args:
            print(json.dumps({"card": card, "layouts": card_report(card)}), flush=True)
