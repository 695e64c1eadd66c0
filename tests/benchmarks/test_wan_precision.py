"""benchmarks.wan_precision: both wakers measured side by side, rows and JSON as documented."""

import json

from benchmarks.wan_precision import WAKERS, main


def test_a_row_per_rtt_and_waker_none_under_the_rtt(tmp_path):
    out_file = tmp_path / "wan.json"
    out = main(["--rtt-ms", "2", "6", "--trips", "3", "--out", str(out_file)])
    rows = out["rows"]
    assert [(r["rtt_ms"], r["waker"]) for r in rows] == [(rtt, w) for rtt in (2.0, 6.0) for w in WAKERS]
    for r in rows:
        assert r["trips"] == 3 and r["min_ms"] >= r["rtt_ms"] and r["p50_ms"] >= r["min_ms"]
        assert abs(r["excess_p50_ms"] - (r["p50_ms"] - r["rtt_ms"] - r["path_p50_ms"])) < 2e-3
    assert json.loads(out_file.read_text()) == out and out["conditions"]["trips"] == 3
