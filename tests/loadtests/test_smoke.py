"""Smoke run of the one command: app + Locust as separate processes, checks on the report.

``python -m loadtests.run --scenario smoke`` starts its own local Ray + Serve in a child
process (Locust must never share a process with Ray), runs 120 simulated edge users of two
tenants (weights 3:1), half of them POSTing each round and half on one WebSocket per session,
for 25 s against a verifier saturated on purpose (one session per forward), on the request
path the project adopts (direct ingress, throughput-optimized Serve), and writes the report;
this test asserts on the report's numbers. Budget: < 2 min.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.request_path import RequestPathConfig

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.ray


def test_smoke_run_report(tmp_path):
    out = tmp_path / "smoke"
    cmd = [sys.executable, "-m", "loadtests.run", "--scenario", "smoke", "--users", "120", "--spawn-rate", "120",
           "--duration", "25s", "--stop-timeout", "10", "--probe-rate", "6", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    detail = (out / "report.md").read_text()

    # the run did real work through the real protocol, over both transports, on the adopted request path
    assert s["acceptance"]["rounds"] > 200, detail
    rows = {r["Name"]: int(r["Request Count"]) for r in csv.DictReader(open(out / "locust_stats.csv"))}
    assert rows.get("verify", 0) > 50 and rows.get("ws verify", 0) > 50, rows
    assert s["request_path"] == RequestPathConfig().model_dump(mode="json")  # the adopted path, all of it
    assert s["request_path"]["ingress"] == "direct" and s["request_path"]["throughput_optimized"]
    assert s["tokens_per_s_window"] > 0
    # zero non-429 errors; every session closed
    assert s["errors"] == 0 and s["locust_failures"] == 0, detail
    assert s["sessions"]["opened"] > 0 and s["sessions"]["unclosed"] == 0, detail
    assert s["sessions"]["closed_by_server"] > 0, detail  # finished sessions closed with their last reply
    # greedy fp32 target: every verified token equals the target's own continuation
    assert s["acceptance"]["diverged_sessions"] == 0, detail
    assert s["acceptance"]["rounds_accepted_other_than_model"] == 0, detail
    # saturated verifier: each tenant's share of tokens within 20% of its weight's share
    assert s["server"]["saturated"], detail
    for name, t in s["tenants"].items():
        assert abs(t["share_over_weight"] - 1.0) <= 0.20, (name, detail)
    # the latency probe ran beside Locust, through the same app, and the report carries it
    probe = s["probe"]["by_status"]
    assert probe.get("verify 200", {}).get("n", 0) > 0 and any(k.startswith("open ") for k in probe), probe
    assert "latency probe" in detail
    # the report's pieces exist: Locust CSVs, markdown, plots
    for f in ("locust_stats.csv", "locust_stats_history.csv", "report.md", "throughput.png", "latency.png",
              "tenant_share.png"):
        assert (out / f).stat().st_size > 0, f
