"""benchmarks.cuda_invariance: its table from the H100 run's JSON, and a clear exit without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import cuda_invariance

H100 = Path(cuda_invariance.RESULTS) / "cuda-invariance-20261127-h100.json"


def test_the_table_has_a_row_per_op_and_implementation():
    result = json.loads(H100.read_text())
    md = cuda_invariance.markdown(result)
    assert "NVIDIA H100" in md
    lines = [x for x in md.splitlines() if x.startswith("| attention")]
    assert [x.split("|")[2].strip() for x in lines] == ["torch", "verifier"]
    ours = [r for r in result["rows"] if r["impl"] == "verifier"]
    assert ours and all(r["differing"] == 0 for r in ours)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cuda_invariance.main([])
