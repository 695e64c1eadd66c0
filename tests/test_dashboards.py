"""dashboards/: Grafana JSON structure, metric names against deploy.metrics, promtool on rules and config.

Every PromQL expression is also executed against a real Prometheus in
tests/test_prometheus_integration.py (with the helpers below).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.metrics import METRICS

DASH = Path(__file__).resolve().parent.parent / "dashboards"
BOARDS = sorted(DASH.glob("*.json"))
RULES = DASH / "alerts.yml"
# Ray Serve's built-in metrics the dashboards and alerts may use besides the app's own
SERVE_BUILTINS = {"ray_serve_num_http_requests_total", "ray_serve_num_http_error_requests_total"}
# what Grafana substitutes at query time, replaced by fixed values to run the expressions directly
GRAFANA_VARS = {"$__rate_interval": "2m", "$__interval": "5s", "$__range": "5m", "$application": ".*",
                "$tenant": ".*", "$replica": ".*"}


def load_boards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in BOARDS}


def panels(board: dict):
    for p in board["panels"]:
        yield p
        yield from p.get("panels", [])


def board_exprs(board: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in panels(board) for t in p.get("targets", [])]


def variable_queries(board: dict) -> list[str]:
    return [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]


def rule_exprs() -> list[tuple[str, str]]:
    data = yaml.safe_load(RULES.read_text())
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in data["groups"] for r in g["rules"]]


def substitute(expr: str) -> str:
    for k in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(k, GRAFANA_VARS[k])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def label_values_to_promql(query: str) -> tuple[str, str]:
    """Grafana's ``label_values(selector, label)`` as a PromQL query and the label it lists."""
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
    assert m, query
    return f"count by ({m.group(2)}) ({substitute(m.group(1))})", m.group(2)


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bray_[a-z0-9_]+", expr))


def spec_of(exposed: str):
    """The :data:`deploy.metrics.METRICS` entry behind an exposed Ray name, checking the suffix fits its kind."""
    base = exposed.removeprefix("ray_")
    for suffix, kinds in (("_total", ("counter",)), ("_bucket", ("histogram",)), ("_sum", ("histogram",)),
                          ("_count", ("histogram",)), ("", ("gauge",))):
        if suffix and not base.endswith(suffix):
            continue
        s = METRICS.get(base[: len(base) - len(suffix)] if suffix else base)
        if s is not None and s.kind in kinds:
            return s
    return None


def test_there_are_three_dashboards():
    assert {p.name for p in BOARDS} == {"fleet_overview.json", "verifier_internals.json", "tenant_usage.json"}


@pytest.mark.parametrize("name", [p.name for p in BOARDS])
def test_dashboard_structure(name):
    b = load_boards()[name]
    assert b["uid"] and b["title"] and b["schemaVersion"] >= 30
    tvars = {v["name"]: v for v in b["templating"]["list"]}
    ds = tvars["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ps = list(panels(b))
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert sum(p["type"] != "row" for p in ps) >= 8
    for p in ps:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and 0 < g["w"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["title"] and p["type"] in ("timeseries", "stat", "gauge", "table", "bargauge", "heatmap")
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no queries"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}"
    for v in tvars.values():  # query variables use the datasource variable too
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}"
            label_values_to_promql(v["query"]["query"])
    # no overlapping panels
    cells = set()
    for p in ps:
        g = p["gridPos"]
        for y in range(g["y"], g["y"] + g["h"]):
            for x in range(g["x"], g["x"] + g["w"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))


def test_dashboard_uids_are_unique():
    uids = [b["uid"] for b in load_boards().values()]
    assert len(uids) == len(set(uids))


def test_every_metric_referenced_exists_with_the_right_kind():
    exprs = [e for b in load_boards().values() for _, e in board_exprs(b)] + [e for _, e in rule_exprs()]
    exprs += [q for b in load_boards().values() for q in variable_queries(b)]
    used = set()
    for e in exprs:
        for n in metric_names(e):
            if n in SERVE_BUILTINS:
                continue
            s = spec_of(n)
            assert s is not None, f"{n} is not a metric of deploy.metrics (or has the wrong suffix for its kind)"
            assert s.component in ("verifier", "router")
            used.add(s.name)
    shown = {s for s in METRICS if s in used}
    # the issue's list: every one of these is on a dashboard or in an alert
    for must in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_per_pos", "verify_batch_sessions", "verify_batch_tokens",
                 "forward_latency_seconds", "queue_wait_seconds", "router_verify_latency_seconds",
                 "edge_reported_rtt_seconds", "edge_reported_draft_forward_seconds", "edge_reported_draft_depth",
                 "open_sessions", "kv_tokens_in_use", "kv_tokens_capacity", "evictions", "router_shed_requests",
                 "pacing_depth_hint", "verifier_busy_seconds", "inter_token_latency_seconds"):
        assert "specedge_" + must in shown, must


def test_no_session_ids_in_queries():
    for b in load_boards().values():
        for _, e in board_exprs(b):
            assert "session" not in re.sub(r"open_sessions|sessions_opened|batch_sessions|forward_sessions", "", e)


def test_alert_rules_cover_the_issue_and_are_annotated():
    data = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"]: r for g in data["groups"] for r in g["rules"] if "alert" in r}
    for name in ("SpecEdgeVerifierSaturated", "SpecEdgeAcceptanceCollapsed", "SpecEdgeHighErrorRate",
                 "SpecEdgeKVPressure"):
        assert name in alerts
    for name, r in alerts.items():
        assert r["labels"]["severity"] in ("info", "warning", "critical"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: run dashboards/install_prometheus.sh (as root)"
    return path


def test_promtool_check_rules():
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in out.stdout


def test_promtool_check_config():
    out = subprocess.run([_promtool(), "check", "config", str(DASH / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_alert_unit_tests_fire_every_alert():
    """dashboards/alerts_test.yml: every alert fires on series showing its condition (and not on healthy ones)."""
    tests = yaml.safe_load((DASH / "alerts_test.yml").read_text())
    fired = {c["alertname"] for t in tests["tests"] for c in t["alert_rule_test"] if c["exp_alerts"]}
    alerts = {n for n, _ in rule_exprs()}
    assert fired == alerts, f"alerts without a firing test: {alerts - fired}"
    out = subprocess.run([_promtool(), "test", "rules", str(DASH / "alerts_test.yml")], capture_output=True,
                         text=True, timeout=120, cwd=DASH)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_readme_documents_every_metric():
    from edge_agent.metrics import EDGE_METRICS

    text = (DASH / "README.md").read_text()
    for s in METRICS.values():
        assert f"`{s.exposed()}`" in text, s.name
    for s in EDGE_METRICS.values():
        assert f"`{s.exposed('')}`" in text, s.name
    for name, _ in rule_exprs():
        assert name in text
