"""The Serve app end to end over HTTP (real Ray Serve, tiny random target)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve

from deploy.application import build_app
from specdec.protocol import VerifyFrame
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from tests.router.oracle_edge import oracle_generate, replica_killer
from tests.serve_apps import delete_app

pytestmark = pytest.mark.ray

VOCAB = 512
TENANTS = [
    {"name": "alpha", "api_key": "alpha-key-123", "max_sessions": 64, "weight": 2},
    {"name": "beta", "api_key": "beta-key-1234", "max_sessions": 64},
    {"name": "small", "api_key": "small-key-123", "max_sessions": 2},
]
TINY = {"model": "tiny-random", "dtype": "float32"}


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference_model():
    return tiny_random_model(seed=0)


def deploy(name: str, args: dict, ray_session) -> str:
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    return f"http://127.0.0.1:{ray_session['http_port']}/{name}"


@pytest.fixture(scope="module")
def two_replicas(ray_session):
    url = deploy("two", {"target": TINY, "verifier": {"num_replicas": 2, "batch_wait_ms": 5},
                         "router": {"tenants": TENANTS}}, ray_session)
    yield url
    delete_app("two")


def run(coro):
    return asyncio.run(coro)


def test_a_prompt_that_begins_like_an_earlier_one_reaches_its_replica_and_cached_pages(two_replicas):
    """Prefix affinity (deploy/router/affinity.py) and the prefix cache across two replicas: while
    a session holds a prompt's pages on one replica (and the router has seen that replica's load
    rise), the same prompt opened again still goes there, not to the idle replica, and starts on
    the first two pages the live session shares."""
    h = {"Authorization": "Bearer alpha-key-123"}
    with httpx.Client(base_url=two_replicas, timeout=60, headers=h) as c:
        for a in (20, 220):
            body = {"prompt_ids": list(range(a, a + 40)), "sampling": {"max_tokens": 8}}
            first = c.post("/v1/sessions", json=body).json()
            time.sleep(2.5)  # the replicas' routing stats (every 1 s) now show the first one busier
            again = c.post("/v1/sessions", json=body).json()
            for sid in (first["session_id"], again["session_id"]):
                assert c.delete(f"/v1/sessions/{sid}").status_code == 200
            assert again["session_id"].split(".")[0] == first["session_id"].split(".")[0], (first, again)
            assert (first["cached_tokens"], again["cached_tokens"]) == (0, 32)


def test_greedy_8_concurrent_sessions_match_reference_with_affinity(two_replicas, reference_model):
    ps = prompts(8)
    refs = [reference_decode(reference_model, p, SamplingParams(max_tokens=40)) for p in ps]

    async def main():
        async with httpx.AsyncClient(base_url=two_replicas, timeout=60) as c:
            return await asyncio.gather(*[
                oracle_generate(c, p, ref, {"max_tokens": 40}, VOCAB, seed=i, key="alpha-key-123")
                for i, (p, ref) in enumerate(zip(ps, refs))])

    results = run(main())
    for (out, stats), ref in zip(results, refs):
        assert out == ref
        assert stats["reopens"] == 0  # a misrouted call would have answered 404 and forced a re-open
    tags = {sid.split(".")[0] for _, stats in results for sid in stats["sessions"]}
    assert len(tags) == 2, "sessions should spread over both replicas"

    # batching really happened: some forward carried more than one session
    handle = serve.get_deployment_handle("Verifier", app_name="two")
    sizes = []
    for tag in tags:
        st_ = handle.get_stats.remote(session_id=f"{tag}.x").result()
        assert st_["replica"] == tag  # the affinity router delivered it to that replica
        sizes += st_["batch_sizes"]
    assert max(sizes) > 1, sizes


def test_tenant_isolation_auth_and_quota(two_replicas, reference_model):
    p = prompts(1, seed=7)[0]
    a = {"Authorization": "Bearer alpha-key-123"}
    b = {"Authorization": "Bearer beta-key-1234"}
    with httpx.Client(base_url=two_replicas, timeout=30) as c:
        d = c.post("/v1/sessions", json={"prompt_ids": p, "sampling": {"max_tokens": 8}}, headers=a).json()
        sid = d["session_id"]
        frame = VerifyFrame(d["prefix_len"], [], []).encode()
        r = c.post(f"/v1/sessions/{sid}/verify", content=frame, headers=b)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert c.delete(f"/v1/sessions/{sid}", headers=b).status_code == 404
        r = c.post(f"/v1/sessions/{sid}/verify", content=frame, headers={"Authorization": "Bearer wrong-key"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert c.post("/v1/sessions", json={"prompt_ids": p}).status_code == 401
        # A's session is untouched by B's attempts
        r = c.post(f"/v1/sessions/{sid}/verify", content=frame, headers=a)
        assert r.status_code == 200
        assert c.delete(f"/v1/sessions/{sid}", headers=a).status_code == 200

        s = {"Authorization": "Bearer small-key-123"}
        opened = [c.post("/v1/sessions", json={"prompt_ids": p}, headers=s) for _ in range(2)]
        assert all(r.status_code == 200 for r in opened)
        r = c.post("/v1/sessions", json={"prompt_ids": p}, headers=s)
        assert r.status_code == 429 and "Retry-After" in r.headers
        assert r.json()["error"]["reason"] == "tenant_sessions"
        for o in opened:
            c.delete(f"/v1/sessions/{o.json()['session_id']}", headers=s)
        assert c.post("/v1/sessions", json={"prompt_ids": p}, headers=s).status_code == 200


def test_bad_input_gets_4xx_and_leaves_the_session_intact(two_replicas, reference_model):
    p = prompts(1, seed=11)[0]
    ref = reference_decode(reference_model, p, SamplingParams(max_tokens=12))
    a = {"Authorization": "Bearer beta-key-1234"}
    with httpx.Client(base_url=two_replicas, timeout=30) as c:
        bad_opens = [b"not json", b"[1,2]", b'{"prompt_ids": []}', b'{"prompt_ids": [99999]}',
                     b'{"prompt_ids": [1], "sampling": {"temperature": -1}}',
                     b'{"prompt_ids": [1], "sampling": {"bogus": 1}}', b'{"prompt_ids": ["x"]}',
                     b'{"prompt_ids": [1], "mode": "weird"}']
        for body in bad_opens:
            r = c.post("/v1/sessions", content=body, headers={**a, "content-type": "application/json"})
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            assert "error" in r.json()
        d = c.post("/v1/sessions", json={"prompt_ids": p, "sampling": {"max_tokens": 12}}, headers=a).json()
        sid, n = d["session_id"], d["prefix_len"]
        bad_frames = {
            "garbage": b"\x00\x01garbage",
            "prefix": VerifyFrame(n + 3, [5], [-1]).encode(),
            "parents": VerifyFrame(n, [5, 6], [1, -1]).encode(),
            "vocab": VerifyFrame(n, [VOCAB + 5], [-1]).encode(),
            "size": VerifyFrame(n, [5] * 65, [-1] * 65).encode(),
            "truncated": VerifyFrame(n, [5, 6], [-1, 0]).encode()[:-3],
            "huge": b"\x00" * (2 << 20),
        }
        for what, body in bad_frames.items():
            r = c.post(f"/v1/sessions/{sid}/verify", content=body, headers=a)
            assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
            assert r.json()["error"]["code"]
        out = [d["first_token"]]
        while True:  # the session continues exactly as if nothing had happened
            truth = ref[len(out):]
            frame = VerifyFrame(n, truth[:3], [-1, 0, 1][: len(truth[:3])]).encode()
            r = c.post(f"/v1/sessions/{sid}/verify", content=frame, headers=a)
            assert r.status_code == 200
            from specdec.protocol import ReplyFrame

            rep = ReplyFrame.decode(r.content)
            out += [truth[i] for i in rep.accepted] + ([rep.bonus] if rep.bonus is not None else [])
            n = rep.prefix_len
            if rep.finished:
                break
        assert out == ref


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=300))
def test_fuzz_verify_endpoint_only_4xx(two_replicas, body):
    with httpx.Client(base_url=two_replicas, timeout=30) as c:
        r = c.post("/v1/sessions/nope.x/verify", content=body, headers={"Authorization": "Bearer beta-key-1234"})
        assert 400 <= r.status_code < 500, r.text


def test_eviction_and_replica_restart_lose_nothing(ray_session, reference_model):
    url = deploy("evict", {"target": TINY, "verifier": {"num_replicas": 1, "kv_budget_tokens": 256,
                                                        "batch_wait_ms": 2}}, ray_session)
    ps = prompts(6, seed=3)
    refs = [reference_decode(reference_model, p, SamplingParams(max_tokens=40)) for p in ps]
    # session 0 kills its own verifier replica after 3 rounds: every session must survive it
    kill_once, killed = replica_killer("Verifier")

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(*[
                oracle_generate(c, p, ref, {"max_tokens": 40}, VOCAB, seed=i,
                                on_round=kill_once if i == 0 else None, max_reopens=60)
                for i, (p, ref) in enumerate(zip(ps, refs))])

    try:
        results = run(main())
    finally:
        delete_app("evict")
    assert killed, "the replica was not found"
    for (out, _), ref in zip(results, refs):
        assert out == ref
    assert sum(s["reopens"] for _, s in results) >= 2  # evictions and the restart forced re-opens


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_openai_completions_server_only_modes(two_replicas, reference_model, mode):
    p = [5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: prompt lookup (sd) has something to propose
    ref = reference_decode(reference_model, p, SamplingParams(max_tokens=16))
    h = {"Authorization": "Bearer small-key-123"}  # two sessions at most: each finished one gives its slot back
    with httpx.Client(base_url=two_replicas, timeout=60, headers=h) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0, "mode": mode})
            assert r.status_code == 200, r.text
            d = r.json()
            assert d["specedge"]["token_ids"] == ref and d["usage"]["completion_tokens"] == 16
        with c.stream("POST", "/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0,
                                                         "mode": mode, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3
        assert c.post("/v1/completions", json={"prompt": "text needs a tokenizer"}).status_code == 400


def test_chain_mode_over_http_greedy_matches_reference(two_replicas, reference_model):
    """DSSD-style chain frames (q(x) per token) through the real app; greedy rejections
    come back with the target's token as the bonus. Each reply states the router's time of its
    round (Server-Timing), within the client's."""
    from specdec import server_timing
    from specdec.protocol import ReplyFrame

    p = prompts(1, seed=21)[0]
    ref = reference_decode(reference_model, p, SamplingParams(max_tokens=20))
    rng = random.Random(0)
    h = {"Authorization": "Bearer beta-key-1234"}
    with httpx.Client(base_url=two_replicas, timeout=30, headers=h) as c:
        d = c.post("/v1/sessions", json={"prompt_ids": p, "mode": "chain", "sampling": {"max_tokens": 20}}).json()
        sid, n, out = d["session_id"], d["prefix_len"], [d["first_token"]]
        rounds = 0
        while True:
            truth = ref[len(out): len(out) + 4]
            chain = [t if rng.random() < 0.7 else rng.randrange(VOCAB) for t in truth]
            frame = VerifyFrame(n, chain, list(range(-1, len(chain) - 1)), q=[0.5] * len(chain)).encode()
            r = c.post(f"/v1/sessions/{sid}/verify", content=frame)
            assert r.status_code == 200, r.text
            served = server_timing.router_ms(r.headers.get(server_timing.HEADER))
            assert served is not None and 0 <= served <= r.elapsed.total_seconds() * 1e3
            rep = ReplyFrame.decode(r.content)
            assert not rep.rejected  # greedy: the server returns the correction itself
            out += chain[: len(rep.accepted)] + [rep.bonus]
            n, rounds = rep.prefix_len, rounds + 1
            if rep.finished:
                break
        assert out == ref and rounds < 20
        bad = VerifyFrame(n, [5, 6], [-1, 0], q=[0.5, 2.0]).encode()  # q outside (0, 1]
        assert c.post(f"/v1/sessions/{sid}/verify", content=bad).status_code in (400, 409)
