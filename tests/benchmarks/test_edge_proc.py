"""The edge process: server-mode chunk counting."""

import pytest

from benchmarks.edge_proc import Edge


def test_server_chunks_are_rounds_and_counts_add_up():
    e = Edge()  # no tokenizer: equal split
    c = e._server_counts([(0.0, ""), (0.1, ""), (0.3, ""), (0.4, "")], n=7, mode="sd")
    assert c["rounds"] == 3 and sum(n for _, n in c["arrivals"]) == pytest.approx(7)
    ar = e._server_counts([(0.0, "a"), (0.1, "b"), (0.2, "c")], n=3, mode="ar")
    assert ar["rounds"] == 2 and [n for _, n in ar["arrivals"]] == [1, 1.0, 1.0]
