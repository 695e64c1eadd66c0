"""benchmarks/gpu_round.py: each case's row next to its floors and the issue's target ratios (the
same code a GPU run takes, on a tiny model on the CPU: every figure present and positive)."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks import gpu_round
from specdec.model.decoder import DecoderModel
from specdec.model.loading import tiny_random_model


def test_cases_are_measured_next_to_their_floors_and_the_targets_read_from_them():
    model = DecoderModel(tiny_random_model(seed=0))
    rows = gpu_round.measure_cases(model, 40, [1, 8], [0, 8], random.Random(0), runs=1, burst=2, warmup=1,
                                   copy_bytes=1 << 20)
    assert [(r["sessions"], r["nodes"], r["rows"]) for r in rows] == [(1, 0, 1), (1, 8, 9), (8, 0, 8), (8, 8, 72)]
    for r in rows:
        assert r["round_ms"] > 0 and r["linears_floor_ms"] > 0 and r["kv_floor_ms"] > 0 and r["attention_ms"] >= 0
        assert r["floor_ratio"] == r["round_ms"] / (r["linears_floor_ms"] + r["kv_floor_ms"])
    s = model.spec
    assert rows[3]["kv_floor_ms"] == pytest.approx(8 * (40 + 9) * 2 * s.num_layers * s.num_kv_heads * s.head_dim * 4 / (
        rows[3]["copy_bandwidth_tb_s"] * 1e12) * 1e3)
    ratios = gpu_round.gpu_ratios(rows, 40)
    assert ratios["tree_8x8_vs_decode_8"] == rows[3]["round_ms"] / rows[2]["round_ms"]
    assert ratios["round_1x0_ms"] == rows[0]["round_ms"] and ratios["attention_32x0_vs_kv_floor"] is None
    table = gpu_round.gpu_markdown({"conditions": dict(model="tiny", dtype="float32", device="cpu", torch=torch.__version__,
                                                       runs=1, burst=2, warmup=1, prefixes=[40]),
                                    "rows": rows, "ratios": {"40": ratios}})
    assert "| 8 x 8 | 72 |" in table and "| tree_8x8_vs_decode_8 |" in table
