"""Router / ingress deployment (FastAPI): auth, tenants, admission, sticky routing, the session protocol.

Endpoints: :mod:`specdec.protocol` (docs/protocol.md); errors are JSON ``{"error": {code, message}}``
with a 4xx status (429 carries ``Retry-After``). How the router is built: docs/router.md."""


import asyncio
import json
import logging

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError, RayError

from deploy import gc_policy
from deploy.config import BASE_ALIAS, DEV_API_KEY, AppConfig, versions_update
from deploy.metrics import router_metrics
from deploy.router.admission import AdmissionControl, inflight_limit
from deploy.router.body import json_object, read_body, within
from deploy.router.early import stream_verify
from deploy.router.fast_shed import RECEIVED_AT, ShedFastPath, admission_refusal
from deploy.router.loads import Loads
from deploy.prefill_forecast import PrefillForecast, deadline_refusal
from deploy.router.open_deadline import DEADLINE_HEADER, request_deadline
from deploy.router.probe import LoadProbe
from deploy.router.server_decode import ServerDecode
from deploy.router.tenants import TenantRegistry, TenantState
from specdec import clock
from specdec import openai as oai
from specdec import server_timing
from specdec.errors import DERIVED_FIELDS, InvalidRequest, Overloaded, PayloadTooLarge, SpecError, UpstreamTimeout
from specdec.openai.streaming import ClosingStream
from specdec.protocol import EARLY_STREAM_MEDIA_TYPE, OpenSession, ReplyFrame, VerifyFrame, asks_early, record
from specdec.version import package_version

log = logging.getLogger("ray.serve")
api = FastAPI(title="specedge", description="Edge-drafted, cloud-verified speculative decoding")


def _replica() -> "Router":
    """This replica's Router instance, as Serve's own class-based routes find it."""
    return serve.get_replica_context().servable_object


def _fast_decide(method: str, path: str, authorization: str | None) -> Overloaded | None:
    return _replica().fast_shed(method, path, authorization)


def _fast_answered(e: Overloaded, seconds: float) -> None:
    _replica().shed_answered(e, seconds)


# in front of FastAPI's routing: refused opens and verifies get their 429 before any parsing
api.add_middleware(ShedFastPath, decide=_fast_decide, on_shed=_fast_answered)


@api.exception_handler(SpecError)
async def _spec_error(request: Request, e: SpecError):
    router_metrics().on_error(e)
    if e.status == 429 and RECEIVED_AT in request.scope:
        router_metrics().on_shed_answered(clock.perf_counter() - request.scope[RECEIVED_AT])
    headers = {"Retry-After": str(e.retry_after_header)} if isinstance(e, Overloaded) else None
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)


class Unavailable(Overloaded):
    """The verifier replica is down or restarting: retry after a short wait."""

    status, code = 503, "unavailable"


def _reason(payload) -> str | None:
    """The ``reason`` of an error payload, if any."""
    return payload.get("error", {}).get("reason") if isinstance(payload, dict) else None


def _raise_for(status: int, payload) -> None:
    if status == 200:
        return
    err = dict(payload.get("error", {})) if isinstance(payload, dict) else {}
    message = err.pop("message", "error")
    details = {k: v for k, v in err.items() if k not in ("code", *DERIVED_FIELDS)}
    # a verifier's 429/503 with a retry_after stays retryable here (the reply's Retry-After)
    e = (Overloaded if "retry_after" in details else SpecError)(message, **details)
    e.status, e.code = status, err.get("code", "error")
    try:
        raise e
    finally:
        del e  # no reference cycle through this frame (see AdmissionControl.check)


@serve.deployment(name="Router")
@serve.ingress(api)
class Router:
    def __init__(self, verifier, config: dict):
        """``verifier``: the Verifier's handle (``split``), or None to build the verifier here (``colocated``)."""
        self.cfg = AppConfig(**config)
        rc = self.cfg.router
        tenants = rc.load_tenants()
        if any(t.name == "dev" and t.api_key_sha256 for t in tenants) and not (rc.tenants or rc.tenants_file):
            log.warning("no tenants configured: accepting the development key %r; configure router.tenants "
                        "or router.tenants_file for production", DEV_API_KEY)
        self.tenants = TenantRegistry(tenants, rc.retry_after_s, self.cfg.verifier.idle_timeout_s)
        self._local = None  # the verifier replica object, when it lives in this replica
        if verifier is None:
            from deploy.router.in_process import InProcessVerifier
            from deploy.verifier.deployment import VerifierDeployment

            self._local = VerifierDeployment(config)
            verifier = InProcessVerifier(self._local)
        self.verifier = verifier
        vc = self.cfg.verifier
        limit = inflight_limit(rc.max_pending_verifies, rc.max_queued_batches, vc.max_batch_sessions,
                               vc.num_replicas, vc.pipeline_parallel_size, rc.num_replicas)
        self.admission = AdmissionControl(limit, weights={t.name: t.weight for t in tenants},
                                          retry_after_s=rc.retry_after_s, max_retry_after_s=rc.max_retry_after_s,
                                          objective_s=rc.latency_objective_s)
        self.prefill = PrefillForecast(retry_after_s=rc.retry_after_s)
        self.metrics = router_metrics()
        self._info: dict | None = None
        self.loads = Loads(self.cfg)  # the tokenizer and the server drafter, at first use
        self.server_decode = ServerDecode(self, self.loads.server_drafter)  # OpenAI requests
        self._created = int(clock.wall())  # the served model's "created" (OpenAI's /v1/models)
        self._versions: list[str] = sorted(self.cfg.target.adapters)  # target versions (LoRA), see reconfigure
        self._versions_configured = False
        self.probe = LoadProbe(on_lag=self.metrics.on_loop_lag, stall_log_s=rc.loop_stall_log_s,
                               log=log)  # started by the first request (needs the loop)
        gc_policy.settle(self.cfg.gc_gen0_threshold)  # last: what the constructor made is frozen

    def fast_shed(self, method: str, path: str, authorization: str | None) -> Overloaded | None:
        """The fast path's question: the 429 for a verify or open admission control refuses now, or None."""
        self.probe.start()
        return admission_refusal(method, path, authorization, self.tenants, self.admission)

    def shed_answered(self, e: Overloaded, seconds: float) -> None:
        """A 429 answered without a verifier call, ``seconds`` after it reached the app."""
        self.metrics.on_error(e)
        self.metrics.on_shed_answered(seconds)
        self.probe.shed_answered(seconds)

    def probe_samples(self) -> dict:
        """Loop-lag and shed-answer samples since the last call (deploy/router/probe.py)."""
        self.probe.start()
        return self.probe.drain()

    async def reconfigure(self, user_config: dict) -> None:
        """Serve's no-restart config update of the target versions' names (``target.adapters``), validated
        as the Verifier's ``reconfigure`` does; a ``colocated`` verifier takes the update too."""
        if self._local is not None:
            await self._local.reconfigure(user_config)
        try:
            self._versions = sorted(versions_update(self.cfg, user_config).target.adapters)
        except ValueError as e:
            if self._versions_configured:
                log.error("target versions update refused, the listed versions are unchanged: %s", e)
                return
            raise
        self._versions_configured = True

    def check_health(self) -> None:
        """Serve's health check: a verifier in this replica must have its batch loop running."""
        if self._local is not None:
            self._local.check_health()

    async def get_stats(self, session_id: str | None = None) -> dict:
        """The verifier replica's statistics through this router; ``session_id`` picks its replica."""
        return await self._call("get_stats", session_id=session_id) if session_id else await self._call("get_stats")

    # -- plumbing -----------------------------------------------------------------------
    async def _call(self, method: str, stream_to=None, **kwargs):
        """Call the verifier; a dead/restarting replica becomes 503 + Retry-After, a call
        over ``router.request_timeout_s`` 504; ``stream_to``: where a streaming call's early frames go."""
        timeout = self.cfg.router.request_timeout_s
        try:
            if stream_to is not None:
                return await within(stream_verify(self.verifier, method, stream_to, kwargs), timeout)
            return await within(getattr(self.verifier, method).remote(**kwargs), timeout)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"the verifier did not answer {method} within {timeout:g} s") from None
        except (RayActorError, RayError) as e:
            log.warning("verifier call %s failed: %s", method, e)
            raise Unavailable("the verifier is restarting; retry shortly", retry_after=1.0,
                              reason="verifier_unavailable") from None

    async def _admitted_call(self, kind: str, method: str, tenant: str, **kwargs):
        """A verifier call under admission control (429 before it queues; see ``admission.py``)."""
        self.admission.check(tenant, kind)
        self.admission.started(tenant)
        t0, latency = clock.perf_counter(), None
        try:
            out = await self._call(method, tenant=tenant, **kwargs)
            if kind == "verify":
                latency = clock.perf_counter() - t0
                self.probe.verify_answered(latency)
            return out
        finally:
            self.admission.finished(tenant, latency)

    async def info(self) -> dict:
        if self._info is None:
            self._info = await self._call("info")
        return self._info

    async def _body(self, request: Request) -> bytes:
        """The request body, bounded in size (413) and in time (408): deploy/router/body.py."""
        return await read_body(request, self.cfg.router.max_body_bytes, self.cfg.router.body_timeout_s)

    async def _json(self, request: Request) -> dict:
        return json_object(await self._body(request))

    # -- session protocol -------------------------------------------------------------
    async def open(self, tenant: TenantState, body: dict, deadline_header: str | None = None,
                   received_at: float | None = None) -> dict:
        """Open a session within its first-token deadline; ``received_at``: ``perf_counter()`` when the
        request reached this router (its body's read counts against the deadline too)."""
        try:
            req = OpenSession(**body)
            deadline = request_deadline(deadline_header, self.cfg.router.open_deadline_s)
        except ValidationError as e:
            raise InvalidRequest(f"invalid open request: {e.errors(include_url=False)[:3]}") from None
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if received_at is not None:
            # past its deadline already, it is refused here only behind other opens: an idle verifier starts it at
            # once, whatever is left of its deadline (the head of its queue is never dropped)
            waited = clock.perf_counter() - received_at
            if waited >= deadline and self.prefill.queued_opens:
                raise deadline_refusal(deadline, self.admission.retry_after)
            deadline = max(0.0, deadline - waited)
        tokens = len(req.prompt_ids) + len(req.generated_ids)
        if tokens > self.cfg.verifier.max_prompt_tokens:  # a 400 at any load, never a retryable 429
            raise InvalidRequest(f"prompt + history of {tokens} tokens exceed verifier.max_prompt_tokens "
                                 f"({self.cfg.verifier.max_prompt_tokens})")
        refused = self.prefill.refusal(deadline)
        if refused is not None:
            raise refused
        self.tenants.admit_session(tenant)
        ticket, measured = self.prefill.started(tokens), False
        try:  # the verifier drops the open if its prefill has not started by the deadline (429)
            status, payload = await self._admitted_call("open", "open_session", tenant=tenant.config.name,
                                                        body=req.model_dump(), deadline_s=deadline)
            measured = status == 200 or _reason(payload) == "open_deadline_passed"
            _raise_for(status, payload)
            self.tenants.session_opened(tenant, payload["session_id"], bool(payload.get("close_on_finish")))
        finally:
            self.prefill.finished(ticket, measured)
            self.tenants.open_done(tenant)
        if payload.get("first_token") is not None:
            self.tenants.session_used(tenant, payload["session_id"], 1)
        if payload.get("finished"):
            self.tenants.session_finished(tenant, payload["session_id"])
        return payload

    async def verify(self, tenant: TenantState, sid: str, frame: bytes, send_early=None) -> bytes:
        """One verify round from the wire (HTTP, WebSocket), its header checked before it queues;
        ``send_early``: where an ``F_EARLY`` frame's early frames go. Returns the verifier's reply frame."""
        self.tenants.check_rate(tenant)
        head = VerifyFrame.header(frame, max_nodes=self.cfg.verifier.max_tree_nodes)
        return await self._verify(tenant, sid, frame, send_early if head.early else None)

    async def verify_frame(self, tenant: TenantState, sid: str, f: VerifyFrame) -> ReplyFrame:
        """One verify round of a frame built here (server-side decoding), encoded and decoded once."""
        self.tenants.check_rate(tenant)
        return ReplyFrame.decode(await self._verify(tenant, sid, f.encode()))

    async def _verify(self, tenant: TenantState, sid: str, frame: bytes, send_early=None) -> bytes:
        t0 = clock.perf_counter()
        early = {"stream_to": send_early} if send_early is not None else {}
        status, payload = await self._admitted_call("verify", "verify_stream" if early else "verify", session_id=sid,
                                                    tenant=tenant.config.name, frame=frame, **early)
        if status in (404, 410):
            self.tenants.session_gone(tenant, sid)
        _raise_for(status, payload)
        out = ReplyFrame.outcome(payload)
        self.tenants.session_used(tenant, sid, out.emitted)
        if out.finished:
            self.tenants.session_finished(tenant, sid)
        self.metrics.on_verify(tenant.config.name, clock.perf_counter() - t0, self.admission.inflight)
        return payload

    async def close(self, tenant: TenantState, sid: str) -> dict:
        status, payload = await self._call("close_session", session_id=sid, tenant=tenant.config.name)
        self.tenants.session_gone(tenant, sid)
        _raise_for(status, payload)
        return payload

    # -- HTTP ----------------------------------------------------------------------------
    @api.get("/v1/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/v1/model")
    async def model(self):
        return {**await self.info(), "version": package_version()}

    @api.get("/v1/stats")
    async def replica_stats(self, request: Request):
        """One verifier replica's counters (``?session_id=``: that session's) and this router's admission state."""
        self.tenants.authenticate(request.headers.get("authorization"))
        stats = await self.get_stats(request.query_params.get("session_id"))
        return {**stats, "router_admission": self.admission.snapshot()}

    @api.post("/v1/sessions")
    async def open_session(self, request: Request):
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        return await self.open(tenant, await self._json(request), request.headers.get(DEADLINE_HEADER),
                               request.scope.get(RECEIVED_AT))

    @api.post("/v1/sessions/{sid}/verify")
    async def verify_http(self, sid: str, request: Request):
        """One verify round; its reply says how long this router held it (``Server-Timing``,
        specdec/server_timing.py: from the fast path's read of the request)."""
        received = request.scope.get(RECEIVED_AT, clock.perf_counter())
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        body = await self._body(request)
        if asks_early(body) and EARLY_STREAM_MEDIA_TYPE in request.headers.get("accept", ""):
            return await self._verify_streamed(tenant, sid, body)
        reply = await self.verify(tenant, sid, body)
        return Response(reply, media_type="application/octet-stream",
                        headers={server_timing.HEADER: server_timing.header_value(clock.perf_counter() - received)})

    async def _verify_streamed(self, tenant: TenantState, sid: str, body: bytes):
        """POST verify of an ``F_EARLY`` frame that accepts the stream (specdec/protocol.py): a chunked
        response of records, the early frames then the reply; an error after an early frame is the last record."""
        early: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.verify(tenant, sid, body, early.put))
        first = asyncio.ensure_future(early.get())
        await asyncio.wait({first, task}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            return Response(record(task.result()), media_type=EARLY_STREAM_MEDIA_TYPE)  # raises a SpecError

        async def records():
            try:
                yield record(first.result())
                while True:
                    get = asyncio.ensure_future(early.get())
                    done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                    if get not in done:
                        get.cancel()
                        break
                    yield record(get.result())
                try:
                    yield record(task.result())
                except SpecError as e:
                    payload = {"status": e.status, **e.to_dict()}
                    router_metrics().on_error(e)  # never a 429: the verifier took the round
                    yield record(json.dumps(payload).encode())
            finally:
                if not task.done():  # the client left mid-round: the round still completes on the replica
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())

        return ClosingStream(records(), media_type=EARLY_STREAM_MEDIA_TYPE)

    @api.delete("/v1/sessions/{sid}")
    async def close_session(self, sid: str, request: Request):
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        return await self.close(tenant, sid)

    @api.websocket("/v1/sessions/{sid}/ws")
    async def verify_ws(self, websocket: WebSocket, sid: str):
        """Pipelined rounds on one connection: binary frame in, binary reply (or JSON error) out."""
        self.probe.start()
        await websocket.accept()
        try:
            auth = websocket.headers.get("authorization") or (
                f"Bearer {websocket.query_params['api_key']}" if "api_key" in websocket.query_params else None)
            tenant = self.tenants.authenticate(auth)
        except SpecError as e:
            router_metrics().on_error(e)
            await websocket.send_text(json.dumps({"status": e.status, **e.to_dict()}))
            await websocket.close(code=4401)
            return
        try:
            while True:
                try:
                    msg = await within(websocket.receive(), self.cfg.router.ws_idle_timeout_s)
                except asyncio.TimeoutError:  # an idle socket holds a connection and a task: let it go
                    await websocket.close(code=4408, reason="idle timeout")
                    return
                if msg.get("type") == "websocket.disconnect":
                    return
                data = msg.get("bytes")
                t0 = clock.perf_counter()
                try:
                    if data is None:
                        raise InvalidRequest("send verify frames as binary messages")
                    if len(data) > self.cfg.router.max_body_bytes:
                        raise PayloadTooLarge("frame too large")
                    await websocket.send_bytes(await self.verify(tenant, sid, data, websocket.send_bytes))
                except SpecError as e:
                    payload = {"status": e.status, **e.to_dict()}
                    if isinstance(e, Overloaded):
                        payload["retry_after"] = e.retry_after
                    await websocket.send_text(json.dumps(payload))
                    if e.status == 429:
                        self.shed_answered(e, clock.perf_counter() - t0)
                    else:
                        router_metrics().on_error(e)
        except WebSocketDisconnect:
            return

    # -- OpenAI-compatible server-only modes ------------------------------------------------
    @api.get("/v1/models")
    async def models(self, request: Request):
        """OpenAI's model list: the one served model (the verifier's target). Needs a tenant key."""
        self.tenants.authenticate(request.headers.get("authorization"))
        return oai.model_list((await self.info())["model"], self._created, self._versions)

    @api.get("/v1/models/{model:path}")
    async def model_card(self, model: str, request: Request):
        """OpenAI's model retrieval: the served model, or 404 model_not_found."""
        self.tenants.authenticate(request.headers.get("authorization"))
        info = await self.info()
        oai.check_model(model, self._model_names(info), self._versions)
        return oai.model_card(model if model in self._versions else info["model"], self._created)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._openai(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._openai(request, chat=True)

    def _model_names(self, info: dict) -> tuple[str, ...]:
        """The base's names a request's ``model`` may say: the verifier's, the configured one, ``base``."""
        return info["model"], self.cfg.target.model, BASE_ALIAS

    async def _openai(self, request: Request, chat: bool):
        """/v1/completions and /v1/chat/completions, decoded on the server (deploy/router/server_decode.py)."""
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        body = await self._json(request)
        tok = await self.loads.tokenizer()
        req = oai.parse_completion(body, tok, chat)
        info = await self.info()
        oai.check_model(req.model, self._model_names(info), self._versions)
        return await self.server_decode.respond(tenant, req, tok, info, self._versions,
                                                request.headers.get(DEADLINE_HEADER), request.scope.get(RECEIVED_AT))

    # -- vLLM's tokenizer and version endpoints -----------------------------------------------
    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        body, tok, info = await self._tokenizer_request(request)
        return oai.tokenize(body, tok, info["max_model_len"])

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        body, tok, info = await self._tokenizer_request(request)
        return oai.detokenize(body, tok, info["vocab_size"])

    async def _tokenizer_request(self, request: Request) -> tuple[dict, object, dict]:
        """A tenant's /tokenize or /detokenize: (its body, the target's tokenizer, the verifier's info)."""
        self.tenants.authenticate(request.headers.get("authorization"))
        body = await self._json(request)
        tok, info = await self.loads.tokenizer(), await self.info()
        oai.check_model(body.get("model"), self._model_names(info), self._versions)
        return body, tok, info

    @api.get("/version")
    async def version(self):
        return oai.server_version()
