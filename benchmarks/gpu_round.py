"""A verify round on a GPU next to its floors, measured in the same process (issue: the GPU verifier
at the hardware limit).

For each case (sessions x draft-shaped trees of n nodes at a prefix), with CUDA graphs on:

- round ms: ``engine.verify`` (forward + walk + KV commit), median of the counted rounds;
- attention ms per forward: the tree attention's kernels (and the chunk merge) in a torch profile of
  eager rounds of the same case, per forward;
- the linears floor: every linear of the model (each layer's qkv, o, gate_up, down and the LM head)
  as a plain ``torch.mm`` at the case's row count, timed alone back to back;
- the KV floor: the KV bytes the forward must read (each session's prefix and tree once) over the
  device's measured copy bandwidth (bytes read + written);
- ratio: round / (linears floor + KV floor), the headline.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.verify_step import Case, measure

ATTENTION_KERNELS = ("_tree_attention_kernel", "_merge_chunks_kernel")
# the targets (H100, Llama-3-8B shape, prefix 1024, bf16)
TARGETS = {
    "attention_32x0_vs_kv_floor": 2.0, "attention_8x8_ms": 1.0, "attention_1x32_ms": 1.0,
    "round_1x0_vs_floor": 1.2, "round_8x0_vs_floor": 1.2, "round_32x0_vs_floor": 1.2, "round_1x0_ms": 7.0,
    "tree_1x32_vs_decode_1": 1.15, "tree_8x8_vs_decode_8": 1.2, "tree_32x8_vs_decode_32": 1.6,
}


def _timed_ms(fn, device: torch.device, reps: int = 10) -> float:
    """Median ms of ``fn`` after one warm-up call (CUDA events on a GPU, the clock elsewhere)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _timed_ms(lambda: dst.copy_(src), device)
    del src, dst
    return 2 * nbytes / (ms / 1e3)


def linears_floor_ms(model, rows: int) -> float:
    """Every linear of ``model`` (a DecoderModel) as a plain ``torch.mm`` at ``rows`` rows."""
    weights = [f.weight for f in model.layer_linears()] + [model.lm_head.weight]
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}

    def run():
        for w in weights:
            torch.mm(xs[w.shape[1]], w.t())
    return _timed_ms(run, model.device, reps=5)


def kv_floor_ms(model, sessions: int, keys_per_session: int, bandwidth: float) -> float:
    """The KV bytes a forward must read (each session's keys once, every layer) over ``bandwidth``."""
    s = model.spec
    per_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim * model.dtype.itemsize
    return sessions * keys_per_session * per_token / bandwidth * 1e3


def attention_ms(case: Case, rounds: int = 3) -> float:
    """The tree attention's GPU time per forward, from a torch profile of eager rounds of ``case``."""
    from torch.profiler import ProfilerActivity, profile

    model = case.engine.runner.model
    graphs, model.graphs = model.graphs, None
    cuda = model.device.type == "cuda"
    try:
        case.run()  # eager kernels compiled
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(rounds):
                case.run()
            if cuda:
                torch.cuda.synchronize()
    finally:
        model.graphs = graphs
    us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
             for e in prof.key_averages() if any(k in e.key for k in ATTENTION_KERNELS))
    return us / 1e3 / rounds


def measure_cases(model, prefix: int, sessions: list[int], nodes: list[int], rng, runs: int, burst: int,
                  warmup: int, copy_bytes: int = 1 << 30) -> list[dict]:
    """Each case alone (built, measured, profiled, freed: the pools of a real-size model's cases
    would not fit the device together), with its floors."""
    device = model.device
    bandwidth = copy_bandwidth(device, copy_bytes)
    rows = []
    for b in sessions:
        for n in nodes:
            case = Case(model, prefix, b, n, rng)
            row = measure([case], runs, warmup, burst)[0]
            row["attention_ms"] = attention_ms(case)
            row["linears_floor_ms"] = linears_floor_ms(model, b * (n + 1))
            row["kv_floor_ms"] = kv_floor_ms(model, b, prefix + n + 1, bandwidth)
            row["floor_ratio"] = row["round_ms"] / (row["linears_floor_ms"] + row["kv_floor_ms"])
            row["copy_bandwidth_tb_s"] = bandwidth / 1e12
            rows.append(row)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def gpu_ratios(rows: list[dict], prefix: int) -> dict:
    """The issue's targets at ``prefix`` (None where a case is missing)."""
    by = {(r["sessions"], r["nodes"]): r for r in rows if r["prefix"] == prefix}
    get = lambda b, n, k: by[(b, n)][k] if (b, n) in by else None  # noqa: E731
    div = lambda a, c: a / c if a is not None and c else None  # noqa: E731
    return {
        "attention_32x0_vs_kv_floor": div(get(32, 0, "attention_ms"), get(32, 0, "kv_floor_ms")),
        "attention_8x8_ms": get(8, 8, "attention_ms"), "attention_1x32_ms": get(1, 32, "attention_ms"),
        "round_1x0_vs_floor": get(1, 0, "floor_ratio"), "round_8x0_vs_floor": get(8, 0, "floor_ratio"),
        "round_32x0_vs_floor": get(32, 0, "floor_ratio"), "round_1x0_ms": get(1, 0, "round_ms"),
        "tree_1x32_vs_decode_1": div(get(1, 32, "round_ms"), get(1, 0, "round_ms")),
        "tree_8x8_vs_decode_8": div(get(8, 8, "round_ms"), get(8, 0, "round_ms")),
        "tree_32x8_vs_decode_32": div(get(32, 8, "round_ms"), get(32, 0, "round_ms")),
    }


def gpu_markdown(result: dict) -> str:
    c = result["conditions"]
    out = [f"Conditions: {c['model']}, {c['dtype']}, on {c['device']}, CUDA graphs on, torch {c['torch']}; "
           f"draft-shaped trees, random tokens; median (min) of {c['runs']} bursts x {c['burst'] - 1} counted "
           f"rounds after {c['warmup']} warm-up; attention from a profile of 3 eager rounds; floors measured in "
           "the same process.", ""]
    for prefix in c["prefixes"]:
        out += [f"**prefix {prefix}**", "",
                "| sessions x nodes | rows | round ms | attention ms/fwd | linears floor ms | KV floor ms | "
                "round / floor |", "|---|---|---|---|---|---|---|"]
        for r in (r for r in result["rows"] if r["prefix"] == prefix):
            out.append(f"| {r['sessions']} x {r['nodes']} | {r['rows']} | {r['round_ms']:.2f} ({r['round_ms_min']:.2f})"
                       f" | {r['attention_ms']:.2f} | {r['linears_floor_ms']:.2f} | {r['kv_floor_ms']:.3f} | "
                       f"{r['floor_ratio']:.2f} |")
        rt = result["ratios"][str(prefix)]
        out += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
        for k, goal in TARGETS.items():
            v = rt.get(k)
            unit = "" if k.endswith("_ms") else "x"
            out.append(f"| {k} | {'-' if v is None else f'{v:.2f}{unit}'} | <= {goal}{unit} | "
                       f"{'-' if v is None else ('yes' if v <= goal else 'no')} |")
        out.append("")
    return "\n".join(out) + "\n"
