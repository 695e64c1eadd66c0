"""The colocated topology in the real Serve app (tiny random target): one deployment whose
replica holds the router and the verifier (deploy/router/in_process.py). Concurrent sessions
are batched together and decode exactly; a killed replica loses nothing a user generated."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from ray import serve

from deploy.application import build_app
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from tests.router.oracle_edge import oracle_generate, replica_killer
from tests.router.test_app import TINY, VOCAB, prompts, reference_model  # noqa: F401 (a fixture)
from tests.serve_apps import delete_app

pytestmark = pytest.mark.ray

APP = "colocated"
KEY = "colo-key-1234"


def deploy(ray_session, name: str, **verifier) -> str:
    args = {"target": TINY, "topology": "colocated", "verifier": {"batch_wait_ms": 5, **verifier},
            "router": {"tenants": [{"name": "colo", "api_key": KEY, "max_sessions": 64}]}}
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    return f"http://127.0.0.1:{ray_session['http_port']}/{name}"


def generate_all(url: str, ps: list[list[int]], refs: list[list[int]], **kw) -> list:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(*[oracle_generate(c, p, ref, {"max_tokens": 40}, VOCAB, seed=i, key=KEY,
                                                          **(kw if i == 0 else {}))
                                          for i, (p, ref) in enumerate(zip(ps, refs))])

    return asyncio.run(main())


def test_one_deployment_batches_concurrent_sessions_exactly(ray_session, reference_model):
    url = deploy(ray_session, APP)
    try:
        assert set(serve.status().applications[APP].deployments) == {"Router"}
        ps = prompts(8, seed=4)
        refs = [reference_decode(reference_model, p, SamplingParams(max_tokens=40)) for p in ps]
        results = generate_all(url, ps, refs)
        for (out, st), ref in zip(results, refs):
            assert out == ref and st["reopens"] == 0
        stats = serve.get_deployment_handle("Router", app_name=APP).get_stats.remote().result()
        assert max(stats["batch_sizes"]) > 1  # sessions shared forwards
        tags = {sid.split(".")[0] for _, st in results for sid in st["sessions"]}
        assert tags == {stats["replica"]}  # session ids carry the one replica's tag
        r = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 200 and r.json()["replica"] == stats["replica"] and "router_admission" in r.json()
        # the pool's capacity as the replica sized it, in tokens and in sessions of max_model_len (issue 53)
        kv = {k: r.json()[k] for k in ("kv_pool_tokens", "kv_budget_tokens", "kv_capacity_sessions", "memory")}
        assert kv["kv_pool_tokens"] == stats["kv_pool_tokens"] > kv["kv_budget_tokens"] >= kv["kv_capacity_sessions"] >= 1
        assert kv["memory"]["device"] == "cpu" and kv["memory"]["for_kv"] > 0
    finally:
        delete_app(APP)


def test_a_killed_replica_loses_nothing(ray_session, reference_model):
    """The replica holds the router too: killing it drops every connection; the edges re-open
    from their histories on the replacement, and every output is exact."""
    url = deploy(ray_session, f"{APP}-kill", kv_budget_tokens=256)
    ps = prompts(6, seed=9)
    refs = [reference_decode(reference_model, p, SamplingParams(max_tokens=40)) for p in ps]
    kill_once, killed = replica_killer("Router")  # session 0 kills the replica after 3 rounds

    try:
        results = generate_all(url, ps, refs, on_round=kill_once, max_reopens=60)
    finally:
        delete_app(f"{APP}-kill")
    assert killed, "the replica was not found"
    for (out, _), ref in zip(results, refs):
        assert out == ref
    assert sum(st["reopens"] for _, st in results) >= 1
