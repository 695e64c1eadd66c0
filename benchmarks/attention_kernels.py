"""How the verifier's tree attention was chosen: candidates measured side by side.

One layer of attention for the embedded target's shapes (9 query heads, 3 KV heads, head
dim 64), bf16, one thread pinned to one core, over the paged pool, for decode batches and
draft trees:

- ``kernel``: the C kernel (``specdec/model/csrc/tree_attention.c``): reads pages in place,
  each row reduced over its own logical sequence;
- ``gather+sdpa``: gather each row's keys from the pool, masked SDPA with GQA (the torch
  fallback, :func:`specdec.model.attention.torch_attention`);
- ``session sdpa``: per-session SDPA over the session's contiguous KV with the tree mask (the
  issue's baseline: needs a contiguous copy of each session's KV from the pages);
- ``flex``: FlexAttention (``torch.compile``; CPU inductor template) with a block mask over
  the gathered, padded KV (``--flex``; the compile time is reported separately).

Each row also says whether the candidate is batch-invariant: a tree row computed within
the batch must equal the same logical sequence computed alone, bit for bit.
``python -m benchmarks.attention_kernels`` prints markdown and writes
``benchmarks/results/attention_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.model.attention import AttentionPlan, row_positions, torch_attention, tree_attention
from specdec.model.batch import ancestor_bits, signed64
from specdec.model.native import PAGE_SIZE

RESULTS = Path(__file__).resolve().parent / "results"
Hq, Hkv, D = 9, 3, 64
TREE = [-1, -1, -1, 0, 0, 1, 3, 6]  # an 8-node draft-shaped tree (parents)


def make_case(sessions: int, prefix: int, tree: list[int] | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = len(tree) if tree else 0
    per = -(-(prefix + 1 + n) // PAGE_SIZE)
    k = torch.randn(sessions * per, Hkv, D, PAGE_SIZE, generator=g).bfloat16()
    v = torch.randn(sessions * per, Hkv, PAGE_SIZE, D, generator=g).bfloat16()
    bt = torch.arange(sessions * per, dtype=torch.int32).view(sessions, per)
    bits = [0] + ([signed64(b) for b in ancestor_bits(tree)] if tree else [])
    rows = [(s, prefix + 1, b) for s in range(sessions) for b in bits]
    plan = AttentionPlan(bt, torch.tensor([r[0] for r in rows], dtype=torch.int32),
                         torch.tensor([r[1] for r in rows], dtype=torch.int32),
                         torch.tensor([r[2] for r in rows], dtype=torch.int64), prefix + 1 + n)
    q = torch.randn(len(rows), Hq, D, generator=g).bfloat16()
    return q, k, v, plan, len(bits)


def session_sdpa(q, k, v, plan: AttentionPlan, scale: float):
    """Per session: its KV made contiguous [Hkv, S, d], SDPA with the tree mask (GQA native)."""
    pos, valid = row_positions(plan)
    out = torch.empty(q.shape, dtype=q.dtype)
    seq = plan.row_seq.long()
    for s in seq.unique().tolist():
        rows = (seq == s).nonzero().flatten()
        S = int(pos[rows].max()) + 1
        pages = plan.block_table[s].long()
        ks = k[pages].permute(1, 0, 3, 2).reshape(Hkv, -1, D)[:, :S]  # [Hkv, S, d] (a copy)
        vs = v[pages].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :S]
        mask = torch.zeros(len(rows), S, dtype=torch.bool)
        mask.scatter_(1, pos[rows].clamp(max=S - 1), valid[rows])
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), ks, vs, attn_mask=mask, scale=scale,
                                           enable_gqa=True)  # [Hq, r, d]
        out[rows] = o.transpose(0, 1)
    return out


def flex_fn():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)

    def run(q, k, v, plan: AttentionPlan, scale: float):
        pos, valid = row_positions(plan)
        N, S = pos.shape
        pages = plan.block_table.long()[plan.row_seq.long()[:, None], pos // PAGE_SIZE]
        kk = k[pages, :, :, pos % PAGE_SIZE].permute(0, 2, 1, 3)  # [N, Hkv, S, d]
        vv = v[pages, :, pos % PAGE_SIZE, :].permute(0, 2, 1, 3)
        bm = create_block_mask(lambda b, h, qi, kv: valid[b, kv], N, None, 1, S, device="cpu")
        return compiled(q.unsqueeze(2), kk, vv, block_mask=bm, scale=scale, enable_gqa=True).squeeze(2)

    return run


def invariant(fn, q, k, v, plan, rows_per_session: int) -> bool:
    """Row 1 of session 0 (a tree node, or the decode row) computed in the batch vs alone."""
    full = fn(q, k, v, plan)
    r = min(1, rows_per_session - 1)
    one = AttentionPlan(plan.block_table[:1], plan.row_seq[r: r + 1], plan.row_len[r: r + 1],
                        plan.row_bits[r: r + 1], plan.max_len)
    return torch.equal(fn(q[r: r + 1], k, v, one)[0], full[r])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--flex", action="store_true", help="also FlexAttention (compiles: ~30 s)")
    ap.add_argument("--out", default=str(RESULTS / "attention_kernels.json"))
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    scale = D ** -0.5
    cands = {"kernel": lambda q, k, v, p: tree_attention(q, k, v, p, scale, kernel=True),
             "gather+sdpa": lambda q, k, v, p: torch_attention(q, k, v, p, scale)}
    compile_s = None
    if args.flex:
        flex = flex_fn()
        cands["flex"] = lambda q, k, v, p: flex(q, k, v, p, scale)
    cases = [("decode", 1, 128, None), ("decode", 16, 128, None), ("decode", 16, 1024, None),
             ("tree 8", 1, 128, TREE), ("tree 8", 16, 128, TREE), ("tree 8", 16, 1024, TREE)]
    rows = []
    for kind, sessions, prefix, tree in cases:
        q, k, v, plan, rps = make_case(sessions, prefix, tree)
        fns = dict(cands, **{"session sdpa": lambda q, k, v, p: session_sdpa(q, k, v, p, scale)})
        ref = fns["gather+sdpa"](q, k, v, plan).float()
        for name, fn in fns.items():
            t0 = time.perf_counter()
            try:
                out = fn(q, k, v, plan)  # warm-up (and, for flex, the compile)
            except Exception as e:  # noqa: BLE001 (flex: inductor's CPU template fails on some shapes)
                rows.append(dict(case=kind, sessions=sessions, prefix=prefix, rows=len(q), candidate=name,
                                 error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
                continue
            if name == "flex" and compile_s is None:
                compile_s = time.perf_counter() - t0
            fn(q, k, v, plan)
            ts = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                fn(q, k, v, plan)
                ts.append((time.perf_counter() - t0) * 1e3)
            rows.append(dict(case=kind, sessions=sessions, prefix=prefix, rows=len(q), candidate=name,
                             ms_median=statistics.median(ts), ms_min=min(ts),
                             max_abs_diff_vs_sdpa=float((out.float() - ref).abs().max()),
                             batch_invariant=invariant(fn, q, k, v, plan, rps)))
    result = {"conditions": {"shapes": f"Hq={Hq} Hkv={Hkv} d={D}, bf16, page {PAGE_SIZE}", "threads": 1,
                             "core": args.core, "runs": args.runs, "torch": torch.__version__,
                             "flex_compile_s": compile_s, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
              "rows": rows}
    lines = ["| case | sessions | prefix | rows | " + " | ".join(f"{c} ms" for c in dict.fromkeys(r["candidate"] for r in rows))
             + " |", "|---|---|---|---|" + "---|" * len(dict.fromkeys(r["candidate"] for r in rows))]
    for kind, sessions, prefix, _t in cases:
        rs = [r for r in rows if (r["case"], r["sessions"], r["prefix"]) == (kind, sessions, prefix)]
        lines.append(f"| {kind} | {sessions} | {prefix} | {rs[0]['rows']} | " + " | ".join(
            "fails to compile" if "error" in r else
            f"{r['ms_median']:.3f}{'' if r['batch_invariant'] else ' (not invariant)'}" for r in rs) + " |")
    print("\n".join(lines))
    print(f"\nOne layer, {result['conditions']['shapes']}, 1 thread on core {args.core}, median of {args.runs}; "
          f"'not invariant': a tree row in the batch differs from the same sequence alone."
          + (f" FlexAttention compile: {compile_s:.0f} s." if compile_s else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
