"""Cost of one batched tree-verification forward vs one plain decode step (SpecEdge §4.3 inputs).

The pacing rule needs the verifier's forward time per batch; the load-aware tree budget needs
how much a tree adds over a plain decode step at each batch size. This measures both on the
embedded SmolLM2-135M-Instruct on CPU:

- ``verify``: B sessions x one ``--nodes``-node draft tree each (prefix ~``--prefix`` tokens), ONE
  forward through the engine's runner (tree masks, padding, KV gather, LM head on every row);
- ``decode``: the same B sessions with empty trees (one new token each: target-only decoding);
- ``hf decode``: a plain HF forward of one token with a ``DynamicCache`` (batch 1), to show the
  runner's own overhead;
- ``round`` columns time a whole ``engine.verify`` call (forward + tree walk + KV commit).

Median of ``--runs`` after ``--warmup`` runs, cases measured round-robin. ``python -m benchmarks.verify_step`` prints a
markdown table and writes JSON to ``benchmarks/results/verify_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from deploy.verifier.engine import OpenRequest, VerifierEngine, VerifyRequest
from deploy.verifier.runner import BatchItem
from deploy.verifier.sampling import SamplingParams
from deploy.verifier.tree import DraftTree, TreeLimits

RESULTS = Path(__file__).resolve().parent / "results"


def draft_shaped_tree(n: int, rng: random.Random, vocab: int, branching=(4, 3, 2, 2, 1, 1, 1, 1)) -> DraftTree:
    """An n-node tree shaped like a pruned SpecExec/Sequoia draft: wide near the root, a chain below."""
    tokens, parents, frontier = [], [], [-1]
    for b in branching:
        nxt = []
        for p in frontier:
            for _ in range(b):
                if len(tokens) == n:
                    return DraftTree(tuple(tokens), tuple(parents))
                tokens.append(rng.randrange(vocab))
                parents.append(p)
                nxt.append(len(tokens) - 1)
        frontier = nxt[:2]  # keep expanding the two best branches only
    while len(tokens) < n:  # deepen the first chain
        tokens.append(rng.randrange(vocab))
        parents.append(len(tokens) - 2 if len(tokens) > 1 else -1)
    return DraftTree(tuple(tokens), tuple(parents))


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def bench_dtype(dtype: str, batches: list[int], nodes: int, prefix: int, runs: int, warmup: int) -> list[dict]:
    """All cases of one dtype, measured round-robin (one run of each case per repetition), so a
    burst of load from other processes spreads over the cases instead of spoiling one of them."""
    from transformers import DynamicCache

    from deploy.verifier.models import load_model

    lm = load_model("embedded", dtype=dtype, device="cpu")
    model, vocab = lm.model, lm.model.config.vocab_size
    rng = random.Random(0)
    cases: list[tuple[dict, object, object]] = []  # (row, forward fn, whole-round fn or None)

    # target-only decode step through HF itself (batch 1, prefix tokens in a DynamicCache)
    prompt = [rng.randrange(vocab) for _ in range(prefix)]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), past_key_values=cache)

    @torch.inference_mode()
    def hf_step():
        model(input_ids=torch.tensor([[prompt[-1]]]), past_key_values=cache)
        cache.crop(-1)  # stay at the same length

    cases.append((dict(dtype=dtype, mode="hf decode", batch=1, nodes=0, prefix=prefix, new_tokens=1), hf_step, None))

    engines = []
    for B in batches:
        eng = VerifierEngine(model, eos_token_ids=(), limits=TreeLimits(max_nodes=max(64, nodes), max_depth=64))
        engines.append(eng)
        for mode, n in (("verify", nodes), ("decode", 0)):
            sids = [f"{mode}-b{B}-{i}" for i in range(B)]
            # prefix lengths ~prefix (+-8) so the batch needs KV padding, as in real traffic
            eng.open([OpenRequest(sid, [rng.randrange(vocab) for _ in range(prefix - 1 + rng.randint(-8, 8))],
                                  SamplingParams(max_tokens=1 << 16, ignore_eos=True)) for sid in sids])
            trees = [draft_shaped_tree(n, rng, vocab) for _ in sids]

            def forward(eng=eng, sids=sids, trees=trees):
                items = [BatchItem(sid, [eng.sessions[sid].prefix[-1], *t.tokens], t.position_offsets(),
                                   t.attention_mask(), list(range(len(t) + 1))) for sid, t in zip(sids, trees)]
                eng.runner.forward(-1, items)
                eng.runner.abort(-1)

            def round_(eng=eng, sids=sids, trees=trees):
                eng.verify([VerifyRequest(sid, t, len(eng.sessions[sid].prefix)) for sid, t in zip(sids, trees)])

            row = dict(dtype=dtype, mode=mode, batch=B, nodes=n, prefix=prefix,
                       new_tokens=sum(len(t) + 1 for t in trees), sids=sids, engine=len(engines) - 1)
            cases.append((row, forward, round_))

    for _ in range(warmup):
        for _row, fwd, rnd in cases:
            fwd()
            if rnd is not None:
                rnd()
    fwd_times: list[list[float]] = [[] for _ in cases]
    rnd_times: list[list[float]] = [[] for _ in cases]
    for _ in range(runs):
        for i, (_row, fwd, rnd) in enumerate(cases):
            fwd_times[i].append(_ms(fwd))
            if rnd is not None:
                rnd_times[i].append(_ms(rnd))
    rows = []
    for (row, _f, _r), ft, rt in zip(cases, fwd_times, rnd_times):
        sids = row.pop("sids", None)
        eng_i = row.pop("engine", None)
        row.update(forward_ms=statistics.median(ft), round_ms=statistics.median(rt) if rt else None, runs_ms=ft)
        if sids is not None:
            row["prefix_after"] = statistics.mean(len(engines[eng_i].sessions[s].prefix) for s in sids)
        rows.append(row)
    decode = {(r["dtype"], r["batch"]): r["forward_ms"] for r in rows if r["mode"] == "decode"}
    for r in rows:
        d = decode.get((r["dtype"], r["batch"]))
        r["vs_decode_same_batch"] = r["forward_ms"] / d if d else None
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict], cond: dict) -> str:
    head = ("| dtype | mode | batch | nodes/session | new tokens | forward ms (median) | forward ms (min) "
            "| round ms (median) | forward ms/session | x decode (same batch) |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['dtype']} | {r['mode']} | {r['batch']} | {r['nodes']} | {r['new_tokens']} "
        f"| {r['forward_ms']:.1f} | {min(r['runs_ms']):.1f} | {_fmt(r['round_ms'], '.1f')} "
        f"| {r['forward_ms'] / r['batch']:.1f} | {_fmt(r['vs_decode_same_batch'], '.2f')} |\n"
        for r in rows)
    notes = (f"\nConditions: {cond['model']}, CPU ({cond['cpu']}), torch {cond['torch']} with "
             f"{cond['threads']} intra-op threads, prefix ~{cond['prefix']} tokens (+-8 per session), "
             f"{cond['nodes']}-node draft-shaped trees, median of {cond['runs']} runs after {cond['warmup']} "
             f"warm-up; load average {cond['loadavg_start']} -> {cond['loadavg_end']} (2-core machine; "
             f"on a shared machine the min is the less disturbed figure).\n")
    return head + body + notes


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "verify_step.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    cond = dict(model="SmolLM2-135M-Instruct (embedded)", cpu=cpu_name(), torch=torch.__version__,
                threads=args.threads, prefix=args.prefix, nodes=args.nodes, runs=args.runs, warmup=args.warmup,
                loadavg_start=round(os.getloadavg()[0], 1), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    rows = []
    for dtype in args.dtypes.split(","):
        rows += bench_dtype(dtype, [int(b) for b in args.batches.split(",")], args.nodes, args.prefix,
                            args.runs, args.warmup)
    cond["loadavg_end"] = round(os.getloadavg()[0], 1)
    result = {"conditions": cond, "rows": rows}
    print(markdown(rows, cond))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
