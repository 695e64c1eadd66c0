"""Batch invariance on CUDA, op by op: torch's kernels against the verifier's (needs a GPU).

For each op of the forward at the embedded SmolLM2-135M's shapes, in bf16: the share of rows
whose bits differ between the row computed alone and the same row inside a batch of M rows,
for torch's own kernel and for the one the verifier runs on CUDA (:mod:`specdec.model.cuda`,
:mod:`specdec.model.row_chunks`), and the time of one call at each M. A row that differs
here is a greedy token that may change with who shares the batch.
``python -m benchmarks.cuda_invariance`` prints markdown and writes JSON to
``benchmarks/results/cuda_invariance.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.verify_step import publish
from specdec.model.loading import EMBEDDED_SHAPES

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, INTER, VOCAB = (EMBEDDED_SHAPES[k] for k in ("hidden_size", "intermediate_size", "vocab_size"))
HQ, HKV = EMBEDDED_SHAPES["num_heads"], EMBEDDED_SHAPES["num_kv_heads"]
HEAD_DIM = HIDDEN // HQ
ROWS = (2, 4, 8, 16, 32, 64, 128, 256, 512)


def _timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def _differing(batched: torch.Tensor, alone) -> float:
    """Share of rows of ``batched`` [M, ...] not bit-equal to ``alone(r)``."""
    rows = range(batched.shape[0])
    return sum(not torch.equal(batched[r], alone(r)) for r in rows) / len(rows)


def linear_cases(g):
    from specdec.model.linear import Linear

    for name, (n, k) in {"qkv": ((HQ + 2 * HKV) * HEAD_DIM, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
                         "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}.items():
        lin = Linear(torch.randn(n, k, generator=g).div(k ** 0.5).bfloat16().cuda())
        yield f"linear {name}", k, (lambda x, w=lin.weight: F.linear(x, w)), lin


def norm_case(g):
    from specdec.model.glue import make_glue, rms_norm

    w = torch.randn(HIDDEN, generator=g).bfloat16().cuda()
    glue = make_glue(torch.device("cuda"), torch.bfloat16)
    return "rms_norm", HIDDEN, (lambda x: rms_norm(x, w, 1e-5)), (lambda x: glue.norm(x, w, 1e-5))


def attention_rows(M: int, g):
    """M decode rows of sessions with prefixes 64..1024 (session 0's row first), one page each 16."""
    from specdec.model.attention import AttentionPlan
    from specdec.model.native import PAGE_SIZE

    lens = [300] + [int(x) for x in torch.randint(64, 1024, (M - 1,), generator=g)]
    width = -(-max(lens) // PAGE_SIZE)
    bt = torch.arange(M * width, dtype=torch.int32).view(M, width)
    plan = AttentionPlan(bt, torch.arange(M, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                         torch.zeros(M, dtype=torch.int64), max(lens))
    return plan.to("cuda")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "cuda_invariance.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cuda_invariance needs a CUDA device")
    from specdec.model.attention import torch_attention, tree_attention

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    cases = list(linear_cases(g)) + [norm_case(g)]
    for name, k, torch_fn, ours in cases:
        x = torch.randn(max(ROWS), k, generator=g).bfloat16().cuda()
        for impl, fn in (("torch", torch_fn), ("verifier", ours)):
            for M in ROWS:
                y = fn(x[:M])
                rows.append(dict(op=name, impl=impl, rows=M, differing=_differing(y, lambda r: fn(x[r: r + 1])[0]),
                                 ms=_timed(lambda: fn(x[:M]))))
    for M in ROWS:
        plan = attention_rows(M, g)
        pages = plan.block_table.numel()
        k = torch.randn(pages, HKV, HEAD_DIM, 16, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(pages, HKV, 16, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(M, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        alone = attention_rows(1, torch.Generator().manual_seed(1))  # session 0's row alone: same pages, same length
        for impl, fn in (("torch", lambda q, p: torch_attention(q, k, v, p, HEAD_DIM ** -0.5)),
                         ("verifier", lambda q, p: tree_attention(q, k, v, p, HEAD_DIM ** -0.5, kernel=True))):
            y = fn(q, plan)
            rows.append(dict(op="attention (session 0's row)", impl=impl, rows=M,
                             differing=float(not torch.equal(y[0], fn(q[:1], alone)[0])), ms=_timed(lambda: fn(q, plan))))
    result = {"conditions": dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bfloat16",
                                 shapes=f"SmolLM2-135M (D {HIDDEN}, I {INTER}, {HQ}/{HKV} heads x {HEAD_DIM}, V {VOCAB})",
                                 date=time.strftime("%Y-%m-%d %H:%M:%S")), "rows": rows}
    publish(result, markdown(result), args.out)
    return result


def markdown(result: dict) -> str:
    c = result["conditions"]
    out = [f"Conditions: {c['device']}, torch {c['torch']}, {c['dtype']}, {c['shapes']}.", "",
           "Rows whose bits differ from the row computed alone (share), and ms per call, by batch rows M", "",
           "| op | impl | " + " | ".join(f"M={m}" for m in ROWS) + " |", "|---|---|" + "---|" * len(ROWS)]
    ops = dict.fromkeys(r["op"] for r in result["rows"])
    for op in ops:
        for impl in ("torch", "verifier"):
            cells = {r["rows"]: r for r in result["rows"] if r["op"] == op and r["impl"] == impl}
            out.append(f"| {op} | {impl} | " + " | ".join(
                f"{cells[m]['differing']:.0%} ({cells[m]['ms']:.3f})" for m in ROWS) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
