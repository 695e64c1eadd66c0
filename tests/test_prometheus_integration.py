"""The Serve app's metrics through a real Prometheus server (Debian package, own config, own port).

Starts the app (tiny random target) on the shared Ray instance, a Prometheus process that
scrapes Ray's metrics export port (and an edge agent's exporter) with the shipped alert
rules, drives traffic over the real protocol (oracle edges, an EdgeAgent, a shed request,
an idle eviction), then asks Prometheus' HTTP API: every metric exists with plausible
values that agree with what the clients saw, and every PromQL expression of the dashboards
and alert rules executes (with data where data must exist). Prometheus is killed by PID.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import httpx
import pytest
import yaml
from ray import serve

from deploy.application import build_app
from deploy.metrics import METRICS
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.metrics import EDGE_METRICS, EdgeMetrics
from tests.conftest import free_port
from tests.router.oracle_edge import oracle_generate
from tests.serve_apps import delete_app
from tests.test_dashboards import (DASH, RULES, board_exprs, label_values_to_promql, load_boards, rule_exprs,
                                   substitute, variable_queries)

pytestmark = pytest.mark.ray

APP = "obs"
VOCAB = 512
TENANTS = [{"name": "alpha", "api_key": "alpha-key-123", "max_sessions": 64},
           {"name": "tiny", "api_key": "tiny-key-1234", "max_sessions": 1}]
ARGS = {"target": {"model": "tiny-random", "dtype": "float32"},
        "verifier": {"batch_wait_ms": 5, "idle_timeout_s": 2.0, "kv_budget_tokens": 100_000},
        "router": {"tenants": TENANTS}}
SEL = f'application="{APP}"'
EVENT_ONLY_COUNTERS = {"specedge_spec_decode_num_truncated_tokens"}
# dashboard panels that may legitimately show nothing after this test's traffic (none so far)
MAY_BE_EMPTY: set[str] = set()


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, **params) -> dict:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
            data = json.loads(r.read())
        assert data["status"] == "success", data
        return data["data"]

    def query(self, expr: str) -> list[dict]:
        d = self.get("/api/v1/query", query=expr)
        return d["result"] if d["resultType"] == "vector" else [{"value": d["result"]}]

    def value(self, expr: str) -> float | None:
        r = self.query(expr)
        assert len(r) <= 1, (expr, r)
        return float(r[0]["value"][1]) if r else None

    def wait(self, expr: str, ok, timeout: float = 40.0) -> float | None:
        deadline = time.monotonic() + timeout
        v = None
        while time.monotonic() < deadline:
            v = self.value(expr)
            if v is not None and ok(v):
                return v
            time.sleep(0.5)
        raise AssertionError(f"{expr} = {v} after {timeout} s")


@pytest.fixture(scope="module")
def app_url(ray_session):
    serve.run(build_app(ARGS), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_session['http_port']}/{APP}"
    delete_app(APP)


@pytest.fixture(scope="module")
def edge_metrics():
    em = EdgeMetrics()
    port = em.serve(0)
    yield em, port
    em.close()


@pytest.fixture(scope="module")
def prometheus(ray_session, edge_metrics, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: run dashboards/install_prometheus.sh (as root)"
    tmp = tmp_path_factory.mktemp("prometheus")
    # the shipped config, with Ray's file service discovery swapped for this test's metrics port
    cfg = yaml.safe_load((DASH / "prometheus.yml").read_text())
    # Ray's /metrics of a shared test Ray is ~0.5 MB and takes seconds on a loaded 2-core machine
    cfg["global"] = {"scrape_interval": "5s", "evaluation_interval": "2s", "scrape_timeout": "5s"}
    cfg["rule_files"] = [str(RULES)]
    (ray_job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "ray"]
    del ray_job["file_sd_configs"]
    ray_job["static_configs"] = [{"targets": [f"127.0.0.1:{ray_session['metrics_port']}"]}]
    cfg["scrape_configs"].append({"job_name": "specedge-edge",
                                  "static_configs": [{"targets": [f"127.0.0.1:{edge_metrics[1]}"]}]})
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        prom = Prometheus(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp / "prometheus.log").read_text()
                time.sleep(0.2)
        prom.wait('count(up{job="ray"} == 1)', lambda v: v == 1, timeout=30)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


@pytest.fixture(scope="module")
def traffic(app_url, prometheus, edge_metrics):
    """Real protocol traffic; returns what the clients observed."""
    model = tiny_random_model(seed=0)
    prompts = [[7 + i, 40 + 3 * i, 99, 5 + i, 300 - i] for i in range(4)]
    refs = [reference_decode(model, p, SamplingParams(max_tokens=24)) for p in prompts]

    obs = {"rounds": 0, "emitted": 0, "sent": 0, "server_rounds": 0}
    alpha = {"Authorization": "Bearer alpha-key-123"}
    tiny = {"Authorization": "Bearer tiny-key-1234"}

    async def generate(c, jobs):
        runs = [oracle_generate(c, prompts[i], refs[i], {"max_tokens": 24}, VOCAB, seed=seed, key=key)
                for i, seed, key in jobs]
        for (out, st), (i, _, _) in zip(await asyncio.gather(*runs), jobs):
            assert out == refs[i]  # a busy machine may idle-evict a session: re-opened, still lossless
            obs["rounds"] += st["rounds"]  # successful rounds only, as the server counts them
            obs["sent"] += st["sent"]  # and their draft nodes
            obs["emitted"] += len(out) - 1  # the first token comes with the first open

    async def wave1():
        async with httpx.AsyncClient(base_url=app_url, timeout=60) as c:
            r = await c.post("/v1/sessions", json={"prompt_ids": [1, 2, 3]}, headers={"Authorization": "Bearer x"})
            assert r.status_code == 401
            idle = await c.post("/v1/sessions", json={"prompt_ids": [3, 4, 5]}, headers=alpha)  # evicted idle
            assert idle.status_code == 200
            held = await c.post("/v1/sessions", json={"prompt_ids": [9, 9, 9]}, headers=tiny)
            shed = await c.post("/v1/sessions", json={"prompt_ids": [9, 9, 8]}, headers=tiny)
            assert shed.status_code == 429 and shed.json()["error"]["reason"] == "tenant_sessions"
            await c.delete(f"/v1/sessions/{held.json()['session_id']}", headers=tiny)
            long = {"prompt": list(range(20, 60)), "max_tokens": 2, "temperature": 0}  # two whole KV pages + 8
            obs["cached"] = []  # the second finds the first's pages in the prefix cache
            for _ in range(2):
                done = (await c.post("/v1/completions", json=long, headers=alpha)).json()
                obs["cached"].append(done["usage"]["prompt_tokens_details"]["cached_tokens"])
                obs["rounds"] += done["specedge"]["rounds"]  # empty trees: rounds without draft nodes
                obs["server_rounds"] += done["specedge"]["rounds"]  # and without edge telemetry
                obs["emitted"] += done["usage"]["completion_tokens"] - 1
            await generate(c, [(0, 0, "alpha-key-123"), (1, 9, "tiny-key-1234")])

    async def wave2():
        async with httpx.AsyncClient(base_url=app_url, timeout=60) as c:
            await generate(c, [(i, i, "alpha-key-123") for i in range(1, 4)] + [(0, 10, "tiny-key-1234")])

    t0 = time.monotonic()
    asyncio.run(wave1())
    # rate() needs a counter seen at a lower value first: Prometheus must scrape wave 1 before wave 2 runs, from
    # the verifier and from the router (another process, with its own flush: the dashboards' router panels)
    for counter in ("spec_decode_num_drafts_total", "router_verify_latency_seconds_count"):
        prometheus.wait(f"sum(ray_specedge_{counter}{{{SEL}}})", lambda v: v == obs["rounds"], timeout=60)
    asyncio.run(wave2())
    obs["agent"] = asyncio.run(_edge_agent_generation(app_url, model, edge_metrics[0]))
    print(f"traffic: {obs['rounds']} oracle rounds + {obs['agent'].rounds} agent rounds in {time.monotonic() - t0:.1f} s")
    return obs


async def _edge_agent_generation(app_url: str, model, em: EdgeMetrics):
    from edge_agent.agent import AgentConfig, EdgeAgent
    from edge_agent.draft_backends import ModelDrafter
    from edge_agent.transport import HttpTransport

    transport = HttpTransport(app_url, api_key="alpha-key-123")
    # no run-ahead: its steps are server rounds the agent does not see as rounds, and whether the pacer
    # hints "no tree" (run-ahead) on the tiny model depends on the machine; the counts below are exact
    agent = EdgeAgent(transport, ModelDrafter(model), config=AgentConfig(mode="stop-and-wait", budget=8, ping_every=4,
                                                                         run_ahead=False))
    try:
        res = await agent.generate([11, 12, 13, 14], SamplingParams(max_tokens=16, ignore_eos=True))
    finally:
        agent.close()
        await transport.aclose()
    em.observe(res.stats)
    return res.stats


def test_metrics_reach_prometheus_with_plausible_values(prometheus, traffic):
    p = prometheus
    agent = traffic["agent"]
    rounds = traffic["rounds"] + agent.rounds
    emitted = traffic["emitted"] + agent.tokens - 1

    def total(name: str, extra: str = "") -> float | None:
        return p.value(f"sum({name}{{{SEL}{extra}}})")

    # each process flushes its metrics every 2 s (tests/conftest.py), Prometheus scrapes every 5 s: wait for them
    p.wait(f"sum(ray_specedge_spec_decode_num_drafts_total{{{SEL}}})", lambda v: v == rounds, timeout=60)
    p.wait(f"sum(rate(ray_specedge_spec_decode_num_drafts_total{{{SEL}}}[2m]))", lambda v: v > 0)
    assert total("ray_specedge_spec_decode_num_emitted_tokens_total") == emitted
    drafted = total("ray_specedge_spec_decode_num_draft_tokens_total")
    accepted = total("ray_specedge_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    assert emitted - rounds <= accepted <= emitted  # every round emits its accepted tokens + (usually) a bonus
    mal = p.value(f"1 + sum(rate(ray_specedge_spec_decode_num_accepted_tokens_total{{{SEL}}}[2m])) / "
                  f"sum(rate(ray_specedge_spec_decode_num_drafts_total{{{SEL}}}[2m]))")
    assert 1.0 < mal <= 1 + 8  # the oracle's chains are at most 8 long
    per_pos = {int(r["metric"]["position"]): float(r["value"][1]) for r in p.query(
        f"sum by (position) (ray_specedge_spec_decode_num_accepted_tokens_per_pos_total{{{SEL}}})")}
    assert sum(per_pos.values()) == accepted
    assert all(per_pos[i] >= per_pos.get(i + 1, 0) for i in per_pos)  # position i+1 needs position i
    tenants = {r["metric"]["tenant"] for r in p.query(f"ray_specedge_spec_decode_num_drafts_total{{{SEL}}}")}
    assert tenants == {"alpha", "tiny"}

    # batches: every forward carries >= 1 session and >= as many tokens as sessions
    fwd = total("ray_specedge_verify_batch_sessions_count", ', kind="verify"')
    sess = total("ray_specedge_forward_sessions_total", ', kind="verify"')
    toks = total("ray_specedge_forward_tokens_total", ', kind="verify"')
    assert 1 <= fwd <= rounds and fwd <= sess and toks >= sess
    # every round is in one forward; a verify forward also counts the prefill chunk riding along with it of a
    # session opened meanwhile (a busy machine may idle-evict a session, whose edge then re-opens it)
    assert rounds <= sess <= rounds + total("ray_specedge_prefill_tokens_total")
    assert total("ray_specedge_verify_batch_tokens_sum", ', kind="verify"') >= fwd  # >= one token per forward
    assert total("ray_specedge_verify_batch_tokens_count", ', kind="verify"') == fwd
    assert total("ray_specedge_verify_batch_sessions_bucket", ', kind="verify", le="0.5"') is None
    assert total("ray_specedge_verify_batch_sessions_count", ', kind="prefill"') >= 1
    lat = p.value(f'histogram_quantile(0.5, sum by (le) (ray_specedge_forward_latency_seconds_bucket{{{SEL}}}))')
    assert 0 < lat < 5
    busy = total("ray_specedge_verifier_busy_seconds_total")
    assert 0 < busy < 120

    # latencies per round: queue wait and router e2e latency once per round, ITL per round
    assert total("ray_specedge_queue_wait_seconds_count") == rounds
    # the router is another process, with its own flush: wait for its last rounds as for the verifier's
    p.wait(f"sum(ray_specedge_router_verify_latency_seconds_count{{{SEL}}})", lambda v: v == rounds, timeout=60)
    itl = p.value(f"histogram_quantile(0.9, sum by (le) (ray_specedge_inter_token_latency_seconds_bucket{{{SEL}}}))")
    assert 0 < itl < 10
    assert 0 < total("ray_specedge_inter_token_latency_seconds_count") <= rounds

    # edge telemetry as reported in the frames: oracle edges send rtt 1 ms, draft 5 ms, depth 8
    assert total("ray_specedge_edge_reported_rtt_seconds_count") >= rounds - agent.rounds
    edge_rounds = traffic["rounds"] - traffic["server_rounds"]
    assert total("ray_specedge_edge_reported_rtt_seconds_bucket", ', le="0.001"') >= edge_rounds
    assert total("ray_specedge_edge_reported_draft_forward_seconds_bucket", ', le="0.005"') >= edge_rounds
    depth = p.value(f"histogram_quantile(0.5, sum by (le) (ray_specedge_edge_reported_draft_depth_bucket{{{SEL}}}))")
    assert 6 <= depth <= 8

    # gauges: sessions per tenant (all closed or evicted by now), KV, pacing, cost model
    p.wait(f"sum(ray_specedge_evictions_total{{{SEL}, reason=\"idle_timeout\"}})", lambda v: v >= 1)
    open_sessions = {r["metric"]["tenant"]: float(r["value"][1])
                     for r in p.query(f"sum by (tenant) (ray_specedge_open_sessions{{{SEL}}})")}
    assert set(open_sessions) == {"alpha", "tiny"} and all(v >= 0 for v in open_sessions.values())
    assert total("ray_specedge_kv_tokens_capacity") == ARGS["verifier"]["kv_budget_tokens"]
    assert 0 <= total("ray_specedge_kv_tokens_in_use") <= ARGS["verifier"]["kv_budget_tokens"]
    assert total("ray_specedge_pending_requests") >= 0
    # mean hints since the last update; a budget of 0 ("no tree", with depth 0) is a valid hint
    depth_hint, budget_hint = (p.value(f"max(ray_specedge_pacing_{h}_hint{{{SEL}}})") for h in ("depth", "budget"))
    assert 0 <= depth_hint <= 12 and 0 <= budget_hint <= 64 and depth_hint <= budget_hint
    cost_b, cost_a = total("ray_specedge_forward_cost_per_token_seconds"), total("ray_specedge_forward_cost_fixed_seconds")
    assert cost_a >= 0 and cost_b >= 0 and cost_a + cost_b > 0  # t = a + b * tokens was fitted
    assert total("ray_specedge_sessions_opened_total") >= 5 + 2
    assert total("ray_specedge_prefill_tokens_total") >= 5 * 5
    assert traffic["cached"] == [0, 32]  # (a re-open after an idle eviction may find its pages too)
    assert 32 <= total("ray_specedge_prefix_cache_hit_tokens_total") < total("ray_specedge_prefill_tokens_total")

    # vLLM's request metrics: 11 new sessions (the idle and held ones, 2 completions, 6 oracle generations,
    # the agent's; re-opens are no new request), 9 of them finished, each with its first token at the open
    assert total("ray_specedge_time_to_first_token_seconds_count") == 11
    assert total("ray_specedge_e2e_request_latency_seconds_count") == 9
    assert total("ray_specedge_request_success_total") == 9
    assert total("ray_specedge_generation_tokens_total") == emitted + 11
    assert total("ray_specedge_prompt_tokens_total") == 3 + 3 + 2 * 40 + 6 * 5 + 4
    e2e = p.value(f"histogram_quantile(0.5, sum by (le) (ray_specedge_e2e_request_latency_seconds_bucket{{{SEL}}}))")
    ttft = p.value(f"histogram_quantile(0.5, sum by (le) (ray_specedge_time_to_first_token_seconds_bucket{{{SEL}}}))")
    assert 0 < ttft < e2e < 60
    assert total("ray_specedge_num_requests_running") >= 0
    # the idle replica's loop refreshes its gauges every 5 s: no open waits any more
    p.wait(f"sum(ray_specedge_num_requests_waiting{{{SEL}}})", lambda v: v == 0, timeout=60)

    # router: shedding and errors by reason/status; Ray Serve's own HTTP metrics next to them
    assert total("ray_specedge_router_shed_requests_total", ', reason="tenant_sessions"') == 1
    assert total("ray_specedge_router_errors_total", ', status="401"') == 1
    assert total("ray_specedge_router_errors_total", ', status="429"') == 1
    assert total("ray_specedge_router_inflight_requests") >= 0
    # Serve's proxy is a third process with its own flush
    p.wait(f'sum(ray_serve_num_http_requests_total{{{SEL}, status_code="200"}})', lambda v: v >= rounds, timeout=60)

    # every metric of deploy.metrics exists (the table is the contract the dashboards use), except counters
    # of events this traffic need not cause: Ray's Counter refuses inc(0), so such a series appears on the
    # first event (server-side truncation happens only when the cost model finds a batch compute-bound)
    # every node sent is verified or cut (a compute-bound batch may cut most of each tree)
    truncated = total("ray_specedge_spec_decode_num_truncated_tokens_total")
    assert truncated is None or truncated > 0
    assert drafted + (truncated or 0) == traffic["sent"] + agent.draft_tokens
    for spec in METRICS.values():
        if spec.name in EVENT_ONLY_COUNTERS:
            continue
        name = spec.exposed() + ("_count" if spec.kind == "histogram" else "")
        assert p.query(f"{name}{{{SEL}}}"), f"{name} missing in Prometheus"

    # the edge agent's own exporter, scraped as its own job
    p.wait('sum(specedge_edge_spec_decode_num_drafts_total{job="specedge-edge"})', lambda v: v == agent.rounds)
    assert p.value("sum(specedge_edge_generated_tokens_total)") == agent.tokens
    assert p.value("sum(specedge_edge_spec_decode_num_accepted_tokens_total)") <= \
        p.value("sum(specedge_edge_spec_decode_num_draft_tokens_total)")
    for spec in EDGE_METRICS.values():
        if spec.name.startswith("specedge_edge_serve_"):  # edge-agent serve's own: tests/edge_agent/test_serve.py
            continue
        name = spec.exposed("") + ("_count" if spec.kind == "histogram" else "")
        assert p.query(name), f"{name} missing"


def test_every_dashboard_and_alert_expression_runs(prometheus, traffic):
    p = prometheus
    p.wait(f"sum(ray_specedge_spec_decode_num_drafts_total{{{SEL}}})", lambda v: v > 0)
    todo = []
    for board_name, board in load_boards().items():
        for q in variable_queries(board):
            expr, label = label_values_to_promql(q)
            values = {r["metric"].get(label) for r in p.query(expr)}
            assert APP in values or label != "application", (q, values)
            assert values, f"{board_name}: variable query {q} lists nothing"
        todo += [(f"{board_name}: {title}: {expr}", substitute(expr).replace('application=~".*"', SEL))
                 for title, expr in board_exprs(board) if title not in MAY_BE_EMPTY]
    deadline = time.monotonic() + 30  # a counter born late (the idle eviction) needs two scrapes for rate()
    while True:
        todo = [(name, q) for name, q in todo if not any(r["value"][1] != "NaN" for r in p.query(q))]
        if not todo or time.monotonic() > deadline:
            break
        time.sleep(1)
    scrapes = p.query('up or scrape_duration_seconds')
    assert not todo, "panels without data:\n" + "\n".join(name for name, _ in todo) + f"\nscrapes: {scrapes}"
    for name, expr in rule_exprs():
        p.query(expr)  # raises unless Prometheus accepts and evaluates it
    # the rule files were loaded and evaluated without error
    deadline = time.monotonic() + 20
    while True:
        groups = p.get("/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
    assert {r["name"] for r in rules} == {n for n, _ in rule_exprs()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
