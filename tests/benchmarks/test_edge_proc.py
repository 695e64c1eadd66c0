"""Aggregation of per-generation edge observations into a configuration's figures."""

import pytest

from benchmarks.edge_proc import Edge, aggregate


def _gen(tokens, rounds, accepted, nodes, aligned, attempts):
    return {"tokens": tokens, "seconds": 2.0, "ttft_s": 0.1, "arrivals": [(0.0, 1), (0.5, 3), (1.0, tokens - 4)],
            "rounds": rounds, "draft_tokens": nodes, "accepted": accepted, "aligned": aligned,
            "align_attempts": attempts, "depth_sum": 3 * rounds, "draft_forwards": 2 * rounds,
            "proactive_forwards": 5, "draft_ms": [4.0, 6.0], "rtt_ms": [15.0], "reopens": 0,
            "verified_nodes": nodes // 2, "confidence": True}


def test_aggregate_edge_generations():
    gens = [_gen(9, 2, 6, 40, 1, 2), _gen(9, 4, 4, 80, 0, 2)]
    a = aggregate(gens, "edge_proactive", wall_s=4.0, depth=3)
    assert a["tokens"] == 18 and a["generations"] == 2
    assert a["tokens_per_verify"] == pytest.approx((18 - 2) / 6)  # opening tokens come with the prefill
    assert a["alignment_rate"] == pytest.approx(0.25)
    assert a["depth_mean"] == pytest.approx(3.0) and a["draft_ms_mean"] == pytest.approx(5.0)
    assert a["up_payload_bytes"] == 20 * 6 + 7 * 120 and a["down_payload_bytes"] == 24 * 6 + 2 * 10
    assert a["sent_nodes_per_round"] == pytest.approx(20) and a["verified_nodes_per_round"] == pytest.approx(10)
    assert sum(w for _, w in a["itl"]) == pytest.approx(16)  # every token after the first is a sample


def test_server_chunks_are_rounds_and_counts_add_up():
    e = Edge()  # no tokenizer: equal split
    c = e._server_counts([(0.0, ""), (0.1, ""), (0.3, ""), (0.4, "")], n=7, mode="sd")
    assert c["rounds"] == 3 and sum(n for _, n in c["arrivals"]) == pytest.approx(7)
    ar = e._server_counts([(0.0, "a"), (0.1, "b"), (0.2, "c")], n=3, mode="ar")
    assert ar["rounds"] == 2 and [n for _, n in ar["arrivals"]] == [1, 1.0, 1.0]
