"""The chaos scenario's configuration and fault schedule (issue 65; the run itself is `make chaos`, the faults on
a real multi-node cluster are tests/loadtests/test_cluster_faults.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loadtests.config import LoadTestConfig, scenario
from loadtests.report import fault_summary
from loadtests.run import fault_schedule


def test_chaos_scenario_is_the_issues_run():
    c = scenario("chaos")
    assert c.cluster_workers == 2 and c.gcs_ft and c.request_path.ingress.value == "proxy"
    v = c.app_config().verifier
    assert v.num_replicas == 3 and v.max_replicas_per_node == 1  # one replica per node: head + 2 workers
    # 20 minutes: a worker node killed every 4 minutes, the GCS once, never while a node is still coming back
    sched = fault_schedule(c, 20 * 60)
    assert sched == [(240.0, "kill_node"), (480.0, "kill_node"), (600.0, "kill_gcs 10"), (720.0, "kill_node"),
                     (960.0, "kill_node")]
    assert fault_schedule(c, 200) == []


def test_chaos_settings_that_cannot_work_are_refused():
    base = scenario("chaos").model_dump()
    for bad, match in [({"gcs_ft": False}, "gcs_restart_at_s needs gcs_ft"),
                       ({"cluster_workers": 0}, "kill_node_at_s needs cluster_workers"),
                       ({"request_path": {"ingress": "direct"}}, "ingress proxy")]:
        with pytest.raises(ValidationError, match=match):
            LoadTestConfig(**{**base, **bad})


def test_fault_summary_measures_recovery_and_the_outage():
    t0 = 1000.0
    tokens = {s: {"default": 100} for s in range(1000, 1100)}
    for s in range(1060, 1063):  # a node lost at 1060: three slow seconds
        tokens[s] = {"default": 20}
    events = [{"t": 1060.2, "event": "node_killed", "node": 1, "replicas": 1, "routers": 0},
              {"t": 1070.0, "event": "node_back"}, {"t": 1075.0, "event": "replicas_restored", "after_node_back_s": 5.0},
              {"t": 1080.0, "event": "gcs_killed", "killed_at": 1080.0, "redis_keys_before": 7},
              {"t": 1085.0, "event": "gcs_started", "started_at": 1085.0}]
    counters = {"tokens_by_second": tokens, "verify_at": {"default": [1079.0, 1081.0, 1084.9, 1086.0]}}
    f = fault_summary(counters, events, {"faults_sent": [(1060.0, "kill_node"), (1080.0, "kill_gcs 5")]}, t0,
                      lambda k: 0)
    (k,) = f["node_kills"]
    assert k["t_s"] == 60.2 and k["tokens_per_s_before"] == 100.0 and k["full_throughput_after_s"] == pytest.approx(2.8)
    assert f["restored_after_s"] == [5.0] and f["nodes_back"] == [70.0]
    assert f["gcs"]["verifies_ok_during_outage"] == 2 and f["gcs"]["down_s"] == 5.0
