"""The CUDA tree attention compiles for an H100 (sm_90) on any machine (Triton's own ptxas, no
GPU): at the head layouts of Llama-3-8B and the embedded model, in bf16, it runs on the tensor
cores (wgmma), pipelines its key/value loads (cp.async) and spills no register to local memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("layout", [(32, 8, 128), (9, 3, 64)])
def test_the_attention_kernel_compiles_for_hopper_without_spills(layout):
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton without its bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.specdec.model.cuda_compile_check", "bfloat16", *map(str, layout)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["stack"] == 0, got  # no spills
    assert "wgmma.mma_async" in got["ops"] and "cp.async" in got["ops"], got
    assert got["shared"] <= 227 * 1024
