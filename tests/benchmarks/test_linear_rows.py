"""The linear-layer benchmark's figures: GB/s of weights and GFLOP/s from the best pass per row count."""

import pytest
import torch

from benchmarks import linear_rows
from specdec.model.linear import Linear


def test_figures_follow_the_best_pass(monkeypatch):
    lins = [Linear(torch.randn(64, 128).bfloat16()), Linear(torch.randn(32, 128).bfloat16())]
    passes = iter([3e-3, 1e-3, 2e-3, 4e-3])  # rows 1, 8, then again: the best of each is kept
    monkeypatch.setattr(linear_rows, "time_pass", lambda linears, rows, g: next(passes))
    out = {r["rows"]: r for r in linear_rows.measure({"layers": lins}, [1, 8], repeats=2)}
    params = 64 * 128 + 32 * 128
    assert out[1]["ms"] == pytest.approx(2.0) and out[8]["ms"] == pytest.approx(1.0)
    assert out[1]["weight_gb_per_s"] == pytest.approx(2 * params / 2e-3 / 1e9)
    assert out[8]["gflop_per_s"] == pytest.approx(2 * 8 * params / 1e-3 / 1e9)


def test_a_pass_runs_every_linear_on_rows_of_its_width():
    seen = []

    class Probe:
        def __init__(self, k):
            self.in_features = k

        def __call__(self, x):
            seen.append(tuple(x.shape))

    assert linear_rows.time_pass([Probe(128), Probe(64)], 3, torch.Generator().manual_seed(0)) >= 0
    assert seen == [(3, 128), (3, 64)]
