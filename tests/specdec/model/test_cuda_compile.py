"""The CUDA tree attention compiles for every card class it runs on (specdec.model.cuda.plan.CARD_CLASSES: A100,
RTX 30xx, Jetson Orin, L4 / RTX 4090, H100, B200, RTX 50xx) on any machine (Triton's own ptxas, no GPU), at the head
layouts of the verifier's targets and the edge's drafts, in bf16, with each card's tile (plan.card_tiles): no
register spilled to local memory, shared memory within the card's per-block limit, the card's tensor-core
instruction (mma.sync, wgmma, tcgen05) and pipelined key/value loads (cp.async). All in one process (~22 s cold,
~3 s once Triton's cache holds them); the table: docs/gpu_attention.md, "Card classes"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_the_attention_kernel_compiles_for_every_card_class_without_spills():
    triton = pytest.importorskip("triton")
    bins = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bins / "ptxas").exists() or not (bins / "ptxas-blackwell").exists():
        pytest.skip("Triton without its bundled ptxas")
    from tests.specdec.model.cuda_compile_check import CARDS, LAYOUTS, MMA, SHARED_LIMIT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.specdec.model.cuda_compile_check", *CARDS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = {r["card"]: r["layouts"] for r in map(json.loads, out.stdout.strip().splitlines())}
    assert sorted(reports) == sorted(CARDS)
    bad = []
    for card, layouts in reports.items():
        assert sorted(layouts) == sorted(LAYOUTS)
        for name, got in layouts.items():
            if got["spills"] or got["stack"] or got["shared"] > SHARED_LIMIT[card] or MMA[card] not in got["ops"] \
                    or "cp.async" not in got["ops"]:
                bad.append((card, name, got))
    assert not bad, bad
