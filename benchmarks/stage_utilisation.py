"""Pipeline stage utilisation with 1 vs several verify batches in flight.

docs/engine.md, "Sharding a large target": a replica's stages only stay busy if several
verify batches are in the pipeline at once (stage i on batch b+1 while stage i+1 is on
batch b). This benchmark runs ``VerifierEngine(model, runner=PipelineRunner(...))`` with
K threads, each verifying its own disjoint set of sessions in a loop (K = batches in
flight), and reports per stage the fraction of the window it spent computing:

- ``busy``: wall time inside forward/commit / window;
- ``cpu``: CPU seconds of the stage process inside them / window (with 1 torch thread
  per stage this is the share of a core actually computed; on an oversubscribed
  machine busy > cpu while a stage waits for a core);
- ``all stages busy at once``: fraction of the window in which every stage is inside a
  forward at the same time (from the stages' forward intervals): ~0 when one batch is
  in flight, the pipeline overlap when several are.

It also reports rounds and verified tokens per second, and a single-process row (the
unsharded ModelRunner, same dtype and threads) for reference. On the 2-core dev box
the absolute speed of 2 stages + driver cannot beat one process; the overlap shows in
the utilisation (K=1: the stages take turns, ~1/pp each; K>1: both busy at once).

``python -m benchmarks.stage_utilisation [--model embedded] [--dtype bfloat16] [--stages 2]
[--inflight 1 2 3] [--seconds 15]`` writes ``benchmarks/results/stage_utilisation.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from pathlib import Path

import torch

from deploy.config import ModelConfig
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeLimits

RESULTS = Path(__file__).resolve().parent / "results"


def random_tree(rng: random.Random, nodes: int, vocab: int) -> DraftTree:
    """A random tree of ``nodes`` nodes (parents-first); its shape, not acceptance, matters here."""
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, nodes)]
    return DraftTree(tuple(rng.randrange(vocab) for _ in range(nodes)), tuple(parents))


def open_group(engine: VerifierEngine, sids: list[str], prompt_len: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    reqs = [OpenRequest(s, [rng.randrange(vocab) for _ in range(prompt_len)], SamplingParams(max_tokens=100_000))
            for s in sids]
    for r in engine.open(reqs):
        assert not isinstance(r, Exception), r


def run_window(engine: VerifierEngine, groups: list[list[str]], seconds: float, nodes: int, vocab: int) -> dict:
    """K threads (one per group) verify their sessions in a loop for ``seconds``."""
    rounds = [0] * len(groups)
    tokens = [0] * len(groups)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(groups) + 1)
    deadline = [0.0]

    def loop(g: int) -> None:
        rng = random.Random(1000 + g)
        try:
            barrier.wait()
            while time.perf_counter() < deadline[0]:
                reqs = [VerifyRequest(s, random_tree(rng, nodes, vocab), len(engine.sessions[s].prefix))
                        for s in groups[g]]
                for r in engine.verify(reqs):
                    if isinstance(r, Exception):
                        raise r
                    tokens[g] += len(r.tokens)
                rounds[g] += 1
        except BaseException as e:  # noqa: BLE001 (reported by the caller)
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(g,), daemon=True) for g in range(len(groups))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    deadline[0] = t0 + seconds
    barrier.wait()
    for t in threads:
        t.join()
    window = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"window_s": window, "rounds": sum(rounds), "tokens": sum(tokens),
            "rounds_per_s": sum(rounds) / window, "tokens_per_s": sum(tokens) / window}


def concurrency(intervals: list[list[tuple[float, float]]], t0: float, t1: float) -> list[float]:
    """Fraction of [t0, t1] during which at least k stages compute, for k = 1..stages."""
    events = []
    for iv in intervals:
        for a, b in iv:
            a, b = max(a, t0), min(b, t1)
            if b > a:
                events += [(a, 1), (b, -1)]
    events.sort()
    at_least = [0.0] * len(intervals)
    level, last = 0, t0
    for t, d in events:
        for k in range(level):
            at_least[k] += t - last
        level, last = level + d, t
    return [x / (t1 - t0) for x in at_least]


def pipeline_rows(args, cfg: ModelConfig) -> tuple[list[dict], list]:
    import ray

    from deploy.verifier.pipeline import PipelineRunner

    runner = PipelineRunner(cfg, args.stages, cpus_per_stage=1, torch_threads=args.threads_per_stage)
    engine = VerifierEngine(runner.loaded.model, eos_token_ids=(), runner=runner,
                            limits=TreeLimits(max_nodes=max(64, args.nodes)))
    vocab = runner.loaded.model.config.vocab_size
    rows = []
    try:
        for k in args.inflight:
            groups = [[f"k{k}-g{g}-s{i}" for i in range(args.sessions)] for g in range(k)]
            for g, grp in enumerate(groups):
                open_group(engine, grp, args.prompt_len, vocab, seed=g)
            run_window(engine, groups, min(2.0, args.seconds), args.nodes, vocab)  # warm-up
            runner.sync()
            runner.reset_stats()
            t0 = time.perf_counter()
            res = run_window(engine, groups, args.seconds, args.nodes, vocab)
            t1 = time.perf_counter()
            runner.sync()
            stats = runner.stage_stats()
            res["stages_busy_at_once"] = concurrency(runner.busy_intervals(), t0, t1)
            res.update(mode=f"pp={args.stages}", inflight=k, sessions_per_batch=args.sessions,
                       stages=[{"layers": [s["first"], s["last"]], "forwards": s["forwards"],
                                "busy": s["busy_s"] / res["window_s"], "cpu": s["cpu_s"] / res["window_s"]}
                               for s in stats])
            rows.append(res)
            print(json.dumps(res))
            for grp in groups:
                for s in grp:
                    engine.close(s)
        slices = runner.slices
    finally:
        runner.shutdown()
        ray.shutdown()
    return rows, slices


def single_process_row(args, cfg: ModelConfig) -> dict:
    """The unsharded verifier in this process, 1 batch at a time (forward time / window)."""
    from specdec.model.loading import load_model

    torch.set_num_threads(args.threads_per_stage)
    loaded = load_model(cfg.model, dtype=cfg.dtype, device="cpu", seed=cfg.seed, tiny_config=cfg.tiny_config)
    busy = [0.0]
    engine = VerifierEngine(loaded.model, limits=TreeLimits(max_nodes=max(64, args.nodes)),
                            on_forward=lambda st: busy.__setitem__(0, busy[0] + st.seconds))
    vocab = loaded.vocab_size
    grp = [f"pp1-s{i}" for i in range(args.sessions)]
    open_group(engine, grp, args.prompt_len, vocab, seed=0)
    run_window(engine, [grp], min(2.0, args.seconds), args.nodes, vocab)
    busy[0] = 0.0
    res = run_window(engine, [grp], args.seconds, args.nodes, vocab)
    res.update(mode="pp=1 (in-process)", inflight=1, sessions_per_batch=args.sessions,
               stages=[{"layers": [0, loaded.model.config.num_hidden_layers], "busy": busy[0] / res["window_s"],
                        "cpu": None, "forwards": None}])
    print(json.dumps(res))
    return res


def markdown(rows: list[dict], meta: dict) -> str:
    n = max(len(r["stages"]) for r in rows)
    head = (["mode", "batches in flight"] + [f"stage {i} busy / cpu" for i in range(n)]
            + ["all stages busy at once", "rounds/s", "tokens/s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["mode"], str(r["inflight"])]
        for i in range(n):
            if i < len(r["stages"]):
                s = r["stages"][i]
                cells.append(f"{s['busy']:.0%}" + (f" / {s['cpu']:.0%}" if s["cpu"] is not None else ""))
            else:
                cells.append("")
        at_once = r.get("stages_busy_at_once")
        cells += [f"{at_once[-1]:.0%}" if at_once else "", f"{r['rounds_per_s']:.2f}", f"{r['tokens_per_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    cond = (f"\nModel {meta['model']} ({meta['dtype']}), stages {meta['slices']}, {meta['threads_per_stage']} "
            f"torch thread(s) per stage, {meta['sessions']} sessions per batch, {meta['nodes']}-node random trees, "
            f"{meta['prompt_len']}-token prompts, {meta['seconds']} s per row, {meta['cpu_count']} CPU cores "
            f"(load average {meta['loadavg'][0]:.1f} at the start: the box is shared).\n"
            "busy: wall time inside forward/commit per window; cpu: CPU time of the stage process in them; "
            "all stages busy at once: fraction of the window in which every stage is inside a forward.\n")
    return "\n".join(lines) + "\n" + cond


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded", help="'embedded' or 'tiny-random' (mid-size random Llama)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--inflight", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--sessions", type=int, default=4, help="sessions per batch (per thread)")
    ap.add_argument("--nodes", type=int, default=16, help="tree nodes per session")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--threads-per-stage", type=int, default=1)
    ap.add_argument("--no-single", action="store_true", help="skip the in-process pp=1 row")
    ap.add_argument("--out", default=str(RESULTS / "stage_utilisation"))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)  # the driver: tree walks and sampling only

    tiny = {"vocab_size": 8192, "hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
            "intermediate_size": 1536} if args.model.startswith("tiny-random") else None
    cfg = ModelConfig(model=args.model, dtype=args.dtype, device="cpu", tiny_config=tiny)
    load_at_start = os.getloadavg()
    import ray

    ray.init(address="local", num_cpus=args.stages + 1, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    rows, slices = pipeline_rows(args, cfg)
    if not args.no_single:
        rows.insert(0, single_process_row(args, cfg))
    meta = {"model": args.model, "dtype": args.dtype, "stages": args.stages, "slices": slices,
            "threads_per_stage": args.threads_per_stage, "sessions": args.sessions, "nodes": args.nodes,
            "prompt_len": args.prompt_len, "seconds": args.seconds, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "loadavg": load_at_start}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = markdown(rows, meta)
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
