"""The replica's counters (deploy/verifier/counters.py): what forwards and requests add up to."""

from __future__ import annotations

from deploy.verifier.counters import MAX_FORWARDS, ReplicaCounters
from specdec.engine import ForwardStats


def test_forwards_add_up_by_kind_and_the_recent_record_stays_bounded():
    c = ReplicaCounters()
    c.on_forward(ForwardStats("prefill", 1, 50, 0.050, cpu_seconds=0.04))
    c.on_forward(ForwardStats("verify", 3, 12, 0.020, prefill_tokens=4, cpu_seconds=0.01))
    c.on_forward(ForwardStats("chain", 2, 6, 0.010, cpu_seconds=0.01))
    c.on_request(0.5)
    d = c.to_dict()
    assert (d["verify_forwards_total"], d["verify_sessions_total"], d["verify_rows_total"]) == (2, 5, 18)
    assert d["prefill_tokens_total"] == 50 + 4 and d["forwards"] == 3 and d["verify_forwards"] == 2
    assert d["busy_cpu_seconds"] == {"prefill": 0.04, "verify": 0.02} and d["batch_sizes"] == [3]
    assert (d["verify_requests_total"], d["verify_request_seconds_total"]) == (1, 0.5)
    for _ in range(MAX_FORWARDS):
        c.on_forward(ForwardStats("verify", 1, 1, 0.001))
    assert len(c.forwards) <= MAX_FORWARDS and c.verify_forwards == 2 + MAX_FORWARDS
