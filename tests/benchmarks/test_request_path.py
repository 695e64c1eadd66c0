"""benchmarks.request_path: per-hop CPU per verify round, HTTP vs WebSocket."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.request_path import per_round, split_roles, summarise, table

REPO = Path(__file__).resolve().parents[2]


def test_roles_split_into_hops_and_net_subtracts_the_idle_rate():
    cpu = split_roles({"proxy": 0.2, "router": 0.3, "verifier": 0.4, "raylet": 0.05, "controller": 0.05})
    assert cpu == pytest.approx({"proxy": 0.2, "router": 0.3, "verifier": 0.4, "ray_rest": 0.1, "server": 1.0})
    pr = per_round(cpu, {"proxy": 0.01, "server": 0.05}, wall_s=2.0, rounds=100)
    assert pr["raw"]["proxy"] == pytest.approx(2000) and pr["net"]["proxy"] == pytest.approx(1800)
    assert pr["net"]["server"] == pytest.approx(9000) and pr["net"]["router"] == pytest.approx(3000)


def test_summary_sums_repeats_per_transport():
    def win(tr, k):
        return {"transport": tr, "rounds": 50, "wall_s": 1.0, "edge_cpu_s": 0.01 * k, "verifier_busy_s": 0.05,
                "latency_ms_p50": 10.0 * k, "cpu_s": split_roles({"proxy": 0.1 * k, "router": 0.1 * k,
                                                                  "verifier": 0.1 * k})}
    s = summarise([win("http", 2), win("ws", 1), win("ws", 1), win("http", 2)], {})
    assert s["http"]["rounds"] == 100 and s["http"]["us_per_round"]["net"]["proxy"] == pytest.approx(4000)
    assert s["ws"]["us_per_round"]["net"]["server"] == pytest.approx(6000)
    assert "| Serve HTTP proxy | 4000 | 2000 | 0.50 |" in table(s)


@pytest.mark.ray
def test_smoke_measures_both_transports_on_the_tiny_model(tmp_path):
    out = tmp_path / "rp.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.request_path", "--smoke", "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["conditions"]["cores_seen"] == [0]
    for tr in ("http", "ws"):
        s = doc["summary"][tr]
        assert s["rounds"] == 40 and s["us_per_round"]["raw"]["server"] > 0
        # on the adopted path (direct ingress) edges reach the router itself: the proxy is off the path
        assert doc["conditions"]["request_path"]["ingress"] == "direct"
        assert s["us_per_round"]["raw"]["verifier"] > 0 and s["us_per_round"]["raw"]["router"] > 0
    assert doc["cheaper"] in ("http", "ws")
    assert "CPU microseconds per verify round" in p.stdout
