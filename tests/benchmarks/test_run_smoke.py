"""Smoke test of the whole suite: `python -m benchmarks.run --quick --smoke` on a tiny random target.

Real processes (Serve app on core 0, edge process on core 1, WAN proxy), one short
generation per session and configuration, each configuration twice (``--repeats 2``). Asserts
only that every one of our modes ran in both repeats, pooled into one row each, that the vLLM
rows were skipped with a reason, that the whole-server CPU came from the server core, and that
the JSON, Parquet and plots were written; nothing about speed.
"""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from benchmarks.run_plan import MODES
from benchmarks.run_report import LATEST_KEYS

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.ray
def test_quick_smoke_run_writes_every_mode(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--smoke", "--repeats", "2", "--out-dir",
                          str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # the peer rows cannot run on the tiny target: one line says so, and our rows still come
    assert "vLLM rows skipped (vllm_ar, vllm_ngram): the target is tiny-random" in out.stdout
    runs = list(tmp_path.glob("*-smoke.json"))
    assert len(runs) == 1
    doc = json.loads(runs[0].read_text())
    assert {r["mode"] for r in doc["rows"]} == set(MODES) and len(doc["rows"]) == len(MODES)
    # each configuration twice, in alternating order, pooled into one row per mode
    assert sorted((d["mode"], d["repeat"]) for d in doc["details"]) == sorted((m, k) for m in MODES for k in (0, 1))
    assert all(r["repeats"] == 2 and len(r["repeat_tokens_per_server_cpu_s"]) == 2 for r in doc["rows"])
    for r in doc["rows"]:
        assert set(LATEST_KEYS) <= set(r)
        assert r["tokens"] > 0 and r["server_tokens_per_busy_s"] > 0
        # whole-server cost: at least the engine's CPU (with server_sd's drafter), from processes on the server core only
        assert 0 < r["tokens_per_server_cpu_s"] <= r["server_tokens_per_cpu_s"]
        assert r["verifier_cpu_s"] + r["server_draft_cpu_s"] <= r["server_cpu_s"] + 1e-9
    for d in doc["details"]:
        # topology colocated (the benchmark's): the router replica holds the verifier
        assert d["server_cpu"]["cores"] == [0] and {"proxy", "router"} <= set(d["server_cpu"]["by_role"])
        assert "verifier" not in d["server_cpu"]["by_role"]
    # the adopted request path (direct ingress): edges reach the router's own port and Serve's HTTP
    # proxy only idles (through the proxy an edge round costs the proxy about what it costs the router)
    assert doc["conditions"]["request_path"]["ingress"] == "direct"
    edge = [d["server_cpu"]["by_role"] for d in doc["details"] if d["mode"].startswith("edge_")]
    proxy, router = sum(r["proxy"] for r in edge), sum(r["router"] for r in edge)
    assert proxy < 0.5 * router, (proxy, router)
    assert doc["conditions"]["target"].startswith("tiny-random")
    b = doc["conditions"]["background_bursts"]  # Ray's agents' periodic bursts, where the run saw two
    assert b is None or b["every_s"] > b["length_s"] > 0 < b["cores"]
    assert all(v.startswith("skipped") for v in doc["conditions"]["peers"].values())
    table = pq.read_table(runs[0].with_suffix(".parquet"))
    assert table.num_rows == len(doc["rows"]) and set(table.column("mode").to_pylist()) == set(MODES)
    assert runs[0].with_suffix(".md").read_text().count("| server_ar |") >= 1
    for suffix in ("_rtt.png", "_modes.png"):
        png = tmp_path / (runs[0].stem + suffix)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "latest.json").exists()  # only --full writes it
