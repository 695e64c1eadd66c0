"""The shed fast path (deploy/router/fast_shed.py) and the load probe (deploy/router/probe.py).

The fast path is checked against the router's own FastAPI error handler: a request shed before
routing must get byte for byte the answer (status, JSON body, Retry-After) that the app gives
when admission control refuses the parsed request, without its body being read; and over a
real uvicorn server the connection stays usable after a shed answer whose body was never read.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from deploy.config import TenantConfig
from specdec.errors import SpecError
from deploy.metrics import router_metrics
from deploy.router.admission import AdmissionControl
from deploy.router.fast_shed import ShedFastPath, admission_refusal, shed_kind
from deploy.router.ingress import _spec_error
from deploy.router.probe import LoadProbe
from deploy.router.tenants import TenantRegistry

KEY = "tenant-key-123"


@pytest.mark.parametrize("method,path,kind", [
    ("POST", "/v1/sessions", "open"),
    ("POST", "/v1/sessions/abc.123/verify", "verify"),
    ("GET", "/v1/sessions", None),
    ("DELETE", "/v1/sessions/abc", None),
    ("POST", "/v1/sessions//verify", None),
    ("POST", "/v1/sessions/a/b/verify", None),
    ("POST", "/v1/chat/completions", None),
    ("POST", "/v1/sessions/abc/ws", None),
])
def test_shed_kind(method, path, kind):
    assert shed_kind(method, path) == kind


class App:
    """A router-shaped app: the ingress's error handler, admission checked after the body is parsed
    (as the router's routes do), the fast path in front, and a count of body reads."""

    def __init__(self, limit: int = 2):
        self.tenants = TenantRegistry([TenantConfig(name="t", api_key=KEY)])
        self.admission = AdmissionControl(limit=limit, retry_after_s=2.0)
        self.fast_on = True
        self.body_reads = 0
        self.answered: list[float] = []
        api = FastAPI()
        api.add_exception_handler(SpecError, _spec_error)
        api.add_middleware(ShedFastPath, decide=self.decide, on_shed=lambda e, s: self.answered.append(s))

        @api.post("/v1/sessions")
        async def open_session(request: Request):
            tenant = self.tenants.authenticate(request.headers.get("authorization"))
            await request.json()
            self.admission.check(tenant.config.name, "open")
            return {"session_id": "s"}

        @api.post("/v1/sessions/{sid}/verify")
        async def verify(sid: str, request: Request):
            tenant = self.tenants.authenticate(request.headers.get("authorization"))
            await request.body()
            self.admission.check(tenant.config.name, "verify")
            return {"ok": sid}

        self.api = api

    def decide(self, method, path, authorization):
        """What Router.fast_shed does."""
        if not self.fast_on:
            return None
        return admission_refusal(method, path, authorization, self.tenants, self.admission)

    async def __call__(self, scope, receive, send):
        async def counted():
            self.body_reads += 1
            return await receive()

        await self.api(scope, counted, send)


def _headers(r: httpx.Response) -> dict:
    return {k: v for k, v in r.headers.items() if k in ("content-type", "content-length", "retry-after")}


@pytest.mark.parametrize("path,body,inflight", [
    ("/v1/sessions", b'{"prompt_ids": [1, 2, 3]}', 1),  # half the limit in flight: new sessions wait
    ("/v1/sessions/s1/verify", b"\x00" * 64, 2),  # the limit in flight: queue full
])
def test_fast_path_answers_what_the_app_answers_without_reading_the_body(path, body, inflight):
    app = App(limit=2)
    for _ in range(inflight):
        app.admission.started("t")

    async def post(fast: bool):
        app.fast_on, app.body_reads = fast, 0
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return await c.post(path, content=body, headers={"Authorization": f"Bearer {KEY}"})

    timed = lambda: router_metrics().exporter.registry.get_sample_value(  # noqa: E731
        "specedge_router_shed_answer_seconds_count") or 0
    before = timed()
    slow = asyncio.run(post(False))
    assert slow.status_code == 429 and app.body_reads >= 1 and not app.answered
    assert timed() == before + 1  # the app's own 429 is timed from the fast path's entry too
    fast = asyncio.run(post(True))
    assert fast.status_code == 429 and app.body_reads == 0 and len(app.answered) == 1
    assert fast.content == slow.content and _headers(fast) == _headers(slow)
    assert fast.json()["error"]["code"] == "overloaded" and fast.headers["retry-after"] == "2"


def test_fast_path_lets_through_what_it_does_not_shed():
    app = App(limit=2)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            ok = await c.post("/v1/sessions", json={"prompt_ids": [1]}, headers={"Authorization": f"Bearer {KEY}"})
            app.admission.started("t")
            app.admission.started("t")  # saturated now, but a bad key is still the app's 401
            bad = await c.post("/v1/sessions", json={"prompt_ids": [1]}, headers={"Authorization": "Bearer nope"})
            return ok, bad

    ok, bad = asyncio.run(main())
    assert ok.status_code == 200 and ok.json() == {"session_id": "s"}
    assert bad.status_code == 401 and not app.answered


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_keep_alive_connection_survives_a_shed_with_an_unread_body():
    """uvicorn (httptools, as Serve runs it) discards the body the fast path never read; the next
    request on the same connection is served."""
    app = App(limit=2)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", lifespan="off",
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 20
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            app.admission.started("t")
            shed = c.post("/v1/sessions", content=b'{"prompt_ids": [' + b"7, " * 20_000 + b'7]}', headers=auth)
            app.admission.finished("t")
            ok = c.post("/v1/sessions", json={"prompt_ids": [1]}, headers=auth)
            one_connection = len(c._transport._pool.connections) == 1
        assert shed.status_code == 429 and shed.json()["error"]["reason"] == "new_sessions_paused"
        assert ok.status_code == 200 and one_connection
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_probe_sees_a_blocked_loop():
    lags: list[float] = []
    probe = LoadProbe(interval_s=0.01, on_lag=lags.append)
    verified = []

    async def main():
        probe.start()
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # the loop is blocked: the sampler's timer fires 0.2 s late
        await asyncio.sleep(0.05)
        probe.shed_answered(0.003)
        probe.on_verify = verified.append
        probe.verify_answered(0.04)
        gc.collect()  # timed by the probe's gc callback: a full (generation-2) collection
        gc.collect(0)
        return probe.drain(), probe.drain()

    got, again = asyncio.run(main())
    assert max(ms for _, ms in got["loop_lag_ms"]) >= 150 and max(lags) >= 0.15
    assert [ms for _, ms in got["shed_ms"]] == [3.0]
    assert [ms for _, ms in got["verify_ms"]] == [40.0] and verified == [0.04]  # and its listener told
    assert len(got["gc_pause_ms"]) >= 2 and all(ms >= 0 for _, ms in got["gc_pause_ms"])
    assert len(got["gc_cpu_ms"]) == len(got["gc_pause_ms"])
    assert len(got["gc_gen"]) == len(got["gc_pause_ms"])
    assert 1 <= sum(g == 2 for _, g in got["gc_gen"]) < len(got["gc_pause_ms"])  # the explicit full one, not the gen-0 one
    assert all(v == [] for v in again.values())  # a drain forgets what it returned


def test_a_loop_waiting_in_its_selector_is_not_reported_as_stalled(caplog):
    """A sampler tick late while the loop waits in its selector is the host's doing (a starved
    process: here, a sampler interval past the watchdog's threshold), not a stall of our code."""
    import logging

    log = logging.getLogger("probe-test-idle")
    probe = LoadProbe(interval_s=1.0, stall_log_s=0.2, log=log)

    async def main():
        probe.start()
        await asyncio.sleep(1.5)  # idle in select between the sampler's ticks

    with caplog.at_level(logging.WARNING, logger="probe-test-idle"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records if r.name == "probe-test-idle"] == []


def test_a_stalled_loop_gets_its_stack_logged_once(caplog):
    # the watchdog names what stopped the loop (the lag alone only says that it stopped): here a
    # function of ours, found in the logged stack; one warning per stall, none while the loop runs
    import logging

    log = logging.getLogger("probe-test")
    probe = LoadProbe(interval_s=0.01, stall_log_s=0.2, log=log)

    def stalling_import_on_the_loop():
        time.sleep(1.5)

    async def main():
        probe.start()
        await asyncio.sleep(0.5)  # running on time: nothing logged
        stalling_import_on_the_loop()
        await asyncio.sleep(0.5)

    with caplog.at_level(logging.WARNING, logger="probe-test"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.name == "probe-test"]
    assert len(warnings) == 1 and "stalling_import_on_the_loop" in warnings[0], warnings
    assert "the event loop has not run for" in warnings[0]
    time.sleep(0.5)  # the loop is closed: the watchdog has ended, not reported the closed loop as a stall
    assert len([r for r in caplog.records if r.name == "probe-test"]) == 1
    assert "loop-stall-watch" not in [t.name for t in threading.enumerate()]
