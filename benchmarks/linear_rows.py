"""The target's linear layers alone, against the rows in a forward: where they stop streaming.

A forward of the embedded SmolLM2-135M streams 212 MB of layer weights (plus the 57 MB LM
head) through :class:`specdec.model.linear.Linear`. With few rows that stream bounds it (the
memory); with many, the VDPBF16PS arithmetic does. This times one pass over every linear of the
30 layers (fused QKV, O, fused gate/up, down: the packed weights on huge pages, in the order a
forward reads them, exactly as the engine holds them) and the LM head, at each row count, one
thread pinned to ``--core``; the passes round-robin over the row counts, and each count's
minimum over ``--repeats`` is reported with the GB/s of weights and GFLOP/s it implies.

``python -m benchmarks.linear_rows [--rows 1,2,4,8,12,16,24,32,64] [--repeats 9]`` prints a
table and writes JSON (``benchmarks/results/linear-rows.json`` by default).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def time_pass(linears: list, rows: int, generator: torch.Generator) -> float:
    """Seconds for one pass of ``rows`` random rows through each linear."""
    xs = [torch.randn(rows, f.in_features, generator=generator).bfloat16() for f in linears]
    t0 = time.perf_counter()
    for f, x in zip(linears, xs):
        f(x)
    return time.perf_counter() - t0


def measure(groups: dict[str, list], rows: list[int], repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    best = {(name, m): float("inf") for name in groups for m in rows}
    for _ in range(repeats):
        for m in rows:
            for name, lins in groups.items():
                best[name, m] = min(best[name, m], time_pass(lins, m, g))
    out = []
    for name, lins in groups.items():
        params = sum(f.out_features * f.in_features for f in lins)
        for m in rows:
            s = best[name, m]
            out.append(dict(part=name, rows=m, ms=1e3 * s, weight_gb_per_s=2 * params / s / 1e9,  # bf16
                            gflop_per_s=2 * m * params / s / 1e9))
    return out


def markdown(result: dict) -> str:
    c = result["conditions"]
    out = [f"Conditions: {c['model']}, bf16, one thread on core {c['core']} ({c['cpu']}), native kernel: "
           f"{c['native']}; minimum of {c['repeats']} passes per row count, round-robin; {c['date']}.", "",
           "| rows | layers' linears ms | GB/s | GFLOP/s | LM head ms | GB/s | GFLOP/s |", "|---|---|---|---|---|---|---|"]
    by = {(r["part"], r["rows"]): r for r in result["rows"]}
    for m in c["rows"]:
        a, h = by["layers", m], by["lm_head", m]
        out.append(f"| {m} | {a['ms']:.2f} | {a['weight_gb_per_s']:.1f} | {a['gflop_per_s']:.0f} | "
                   f"{h['ms']:.2f} | {h['weight_gb_per_s']:.1f} | {h['gflop_per_s']:.0f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32,64")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "linear-rows.json"))
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    from benchmarks.proc_stats import cpu_name
    from specdec.model.decoder import DecoderModel
    from specdec.model.loading import load_model

    dm = DecoderModel(load_model("embedded", dtype="bfloat16", device="cpu").model)
    rows = [int(x) for x in args.rows.split(",")]
    groups = {"layers": dm.layer_linears(), "lm_head": [dm.lm_head]}
    with torch.inference_mode():
        measure(groups, rows[:1], 2)  # warm-up
        result = {"conditions": dict(model="SmolLM2-135M-Instruct (embedded)", core=args.core, cpu=cpu_name(),
                                     native=dm.lm_head.lib is not None, repeats=args.repeats, rows=rows,
                                     date=time.strftime("%Y-%m-%d %H:%M:%S")),
                  "rows": measure(groups, rows, args.repeats)}
    print(markdown(result))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
