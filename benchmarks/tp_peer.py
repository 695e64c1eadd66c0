"""vLLM-CPU beside :mod:`benchmarks.tensor_parallel` (issue 64): its decode step at tensor_parallel_size 1 and 2.

vLLM has no tree verify, so what is compared is one vLLM decode step of N sequences (N rows, each attending a
~PREFIX-token KV) against our verify round of N sessions (N x 9 rows: an 8-node tree + the last token each, over
a PREFIX-token KV). Each vLLM figure comes from ``benchmarks/peers/vllm_step.py`` run in ``.venv-vllm`` (its
``--method step``: each ``LLMEngine.step()`` of a full decode batch timed; the fastest repetition's mean step,
and the median), TP 1 bound to core 0, TP 2 with ``VLLM_CPU_OMP_THREADS_BIND='0|1'`` (one OpenMP thread a rank,
each on its core). At TP 2 it also times vLLM's own all-reduce alone in each rank (its shared-memory
all-reduce when the CPU communicator sets one up, else gloo) at the rows of a decode step and of our rounds.

The embedded checkpoint is the project's converted SmolLM2-135M; a random shape is written as a checkpoint
(config.json + model.safetensors, the same random weights :func:`benchmarks.tensor_parallel.random_weights`
draws for our rows) into a temporary directory, without a tokenizer (vLLM then runs on token ids).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

COMPARED = ("vLLM row N: one decode step (LLMEngine.step) of N sequences, N rows each attending its ~prefix-token "
            "KV, the fastest repetition's mean over the timed steps (step_ms) and the median over repetitions; "
            "our row S: one verify round of S sessions, S x (tree_nodes + 1) rows over a prefix-token KV each. "
            "vLLM N = tree_nodes + 1 has as many rows as our S = 1.")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def checkpoint_config(shape: str) -> dict:
    """The config.json of ``shape`` (benchmarks/model_shapes.json) as the random checkpoint carries it: an untied
    head (as our rows use) and the architecture transformers / vLLM load it with."""
    from benchmarks.model_shapes import SHAPES

    cfg = dict(SHAPES[shape])
    cfg["tie_word_embeddings"] = False
    cfg["architectures"] = [ARCHITECTURES[cfg["model_type"]]]
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def write_random_checkpoint(shape: str, out_dir: str | Path, seed: int = 0) -> Path:
    """``out_dir``/config.json and model.safetensors of ``shape`` with the weights our benchmark draws (bf16,
    N(0, 0.02), norms 1); parameters only (the rotary buffers are recomputed by any loader)."""
    from safetensors.torch import save_file

    from benchmarks.tensor_parallel import random_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = random_weights(shape, seed)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    del model
    (out / "config.json").write_text(json.dumps(checkpoint_config(shape), indent=1))
    return out


def _one(model_dir: Path, tp: int, prefix: int, sessions: list[int], steps: int, reps: int, timeout: float,
         allreduce_rows: list[int]) -> dict | str:
    """One vLLM run: its JSON, or 'not run: <why>' with the log's last error line."""
    from benchmarks.peers import run_vllm_step

    extra = ["--kv-gib", "1", "--warmup", "1"]
    if tp > 1 and allreduce_rows:
        extra += ["--allreduce-rows", ",".join(str(r) for r in allreduce_rows)]
    with tempfile.NamedTemporaryFile(prefix=f"vllm_tp{tp}_", suffix=".log", delete=False) as lf:
        log = Path(lf.name)
    got = run_vllm_step(prefix, sessions, 0, timeout, steps=steps, reps=reps, extra_args=extra, log_path=log,
                        tp=tp, bind="|".join(str(r) for r in range(tp)) if tp > 1 else None, model_dir=model_dir)
    if got is not None:
        log.unlink(missing_ok=True)
        return got
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    errs = [ln for ln in lines if re.search(r"(Error|error)[:,]", ln)]
    return f"not run: {(errs or lines or ['no output'])[-1][:600]} (log {log})"


def _summary(got: dict | str) -> dict | str:
    """Per batch: the fastest repetition's mean decode step and the median over repetitions (ms)."""
    if isinstance(got, str):
        return got
    out = {str(r["batch"]): {"step_ms": r["step_ms_min"], "median_ms": r["step_ms_median"], "reps": r["reps"],
                             "prefill_ms_median": r["prefill_ms_median"],
                             # CPU time / wall of the driving process (engine core in-process at TP 1: the
                             # forward too; at TP 2 only scheduling and its wait on the workers' replies)
                             "driver_cpu_share": r["cpu_share"]} for r in got["rows"]}
    c = got["conditions"]
    out["conditions"] = {k: c.get(k) for k in ("vllm_version", "dtype", "tensor_parallel_size", "omp_threads_bind",
                                               "decode_steps_per_rep", "reps", "prefix", "startup_s",
                                               "loadavg_start", "loadavg_end")}
    if "allreduce_alone" in got:
        out["allreduce_alone"] = got["allreduce_alone"]
    return out


def vllm_rows(shapes: list[str], sessions: list[int], prefix: int, nodes: int, steps: int = 8,
              reps: int = 3, timeout: float = 900) -> dict:
    """``{shape: {"vllm-tp1-1core": ..., "vllm-tp2-2cores": ...}}`` or one 'not run: ...' string for all."""
    from benchmarks.peers import MODEL_DIR, vllm_unavailable_reason

    why = vllm_unavailable_reason()
    if why:
        return {"not run": why}
    out = {}
    probe = sorted(set(sessions) | {s * (nodes + 1) for s in sessions})
    for shape in shapes:
        with tempfile.TemporaryDirectory(prefix=f"tp_peer_{shape}_") as tmp:
            model_dir = MODEL_DIR if shape == "embedded" else write_random_checkpoint(shape, tmp)
            res = {}
            for tp in (1, 2):
                key = f"vllm-tp{tp}-{tp}core{'s' if tp > 1 else ''}"
                res[key] = r = _summary(_one(model_dir, tp, prefix, sessions, steps, reps, timeout, probe))
                print(shape, key, json.dumps(r)[:1500], flush=True)
            out[shape] = res
    return out
