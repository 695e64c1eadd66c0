"""Router / ingress deployment (FastAPI): auth, tenants, admission, sticky routing.

Endpoints are documented in :mod:`deploy.protocol`; OpenAI-compatible server-only
modes in :mod:`deploy.router.openai`. Every input is validated here or by the
verifier before it can touch a session; errors are JSON ``{"error": {code, message}}``
with a 4xx status (429 carries ``Retry-After``). Verifier calls carry
``session_id=`` so :class:`deploy.router.affinity.SessionAffinityRouter` pins them to
the replica that holds the session's KV.
"""


import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError, RayError

from deploy.config import DEV_API_KEY, AppConfig
from deploy.errors import InvalidRequest, Overloaded, PayloadTooLarge, SpecError
from deploy.metrics import router_metrics
from deploy.protocol import OpenSession, ReplyFrame, VerifyFrame
from deploy.router import openai as oai
from deploy.router.admission import AdmissionControl, inflight_limit
from deploy.router.tenants import TenantRegistry, TenantState

log = logging.getLogger("ray.serve")
api = FastAPI(title="specedge", description="Edge-drafted, cloud-verified speculative decoding")


@api.exception_handler(SpecError)
async def _spec_error(_request: Request, e: SpecError):
    router_metrics().on_error(e)
    headers = {"Retry-After": f"{max(1, round(e.retry_after))}"} if isinstance(e, Overloaded) else None
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)


class Unavailable(Overloaded):
    """The verifier replica is down or restarting: retry after a short wait."""

    status, code = 503, "unavailable"


def _raise_for(status: int, payload) -> None:
    if status == 200:
        return
    err = dict(payload.get("error", {})) if isinstance(payload, dict) else {}
    e = SpecError(err.pop("message", "error"), **{k: v for k, v in err.items() if k != "code"})
    e.status, e.code = status, err.get("code", "error")
    raise e


@serve.deployment(name="Router")
@serve.ingress(api)
class Router:
    def __init__(self, verifier, config: dict):
        self.cfg = AppConfig(**config)
        rc = self.cfg.router
        tenants = rc.load_tenants()
        if any(t.name == "dev" and t.api_key_sha256 for t in tenants) and not (rc.tenants or rc.tenants_file):
            log.warning("no tenants configured: accepting the development key %r; configure router.tenants "
                        "or router.tenants_file for production", DEV_API_KEY)
        self.tenants = TenantRegistry(tenants, rc.retry_after_s, self.cfg.verifier.idle_timeout_s)
        self.verifier = verifier
        vc = self.cfg.verifier
        limit = inflight_limit(rc.max_pending_verifies, rc.max_queued_batches, vc.max_batch_sessions,
                               vc.num_replicas, vc.pipeline_parallel_size, rc.num_replicas)
        self.admission = AdmissionControl(limit, weights={t.name: t.weight for t in tenants},
                                          retry_after_s=rc.retry_after_s, max_retry_after_s=rc.max_retry_after_s)
        self.metrics = router_metrics()
        self._info: dict | None = None
        self._tokenizer = None
        self._tokenizer_loaded = False

    # -- plumbing -----------------------------------------------------------------------
    async def _call(self, method: str, **kwargs):
        """Call the verifier; a dead/restarting replica becomes 503 + Retry-After."""
        try:
            return await getattr(self.verifier, method).remote(**kwargs)
        except (RayActorError, RayError) as e:
            log.warning("verifier call %s failed: %s", method, e)
            raise Unavailable("the verifier is restarting; retry shortly", retry_after=1.0,
                              reason="verifier_unavailable") from None

    async def _admitted_call(self, kind: str, method: str, tenant: str, **kwargs):
        """A verifier call under admission control (429 before it queues; see ``admission.py``)."""
        self.admission.check(tenant, kind)
        self.admission.started(tenant)
        try:
            return await self._call(method, tenant=tenant, **kwargs)
        finally:
            self.admission.finished(tenant)

    async def info(self) -> dict:
        if self._info is None:
            self._info = await self._call("info")
        return self._info

    def tokenizer(self):
        if not self._tokenizer_loaded:
            from deploy.verifier.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.cfg.target.model, self.cfg.target.tokenizer)
            self._tokenizer_loaded = True
        return self._tokenizer

    async def _body(self, request: Request) -> bytes:
        body = await request.body()
        if len(body) > self.cfg.router.max_body_bytes:
            raise PayloadTooLarge(f"body of {len(body)} bytes exceeds {self.cfg.router.max_body_bytes}")
        return body

    async def _json(self, request: Request) -> dict:
        try:
            data = json.loads(await self._body(request) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise InvalidRequest("body must be a JSON object")
        return data

    # -- session protocol -------------------------------------------------------------
    async def open(self, tenant: TenantState, body: dict) -> dict:
        try:
            req = OpenSession(**body)
        except ValidationError as e:
            raise InvalidRequest(f"invalid open request: {e.errors(include_url=False)[:3]}") from None
        self.tenants.admit_session(tenant)
        status, payload = await self._admitted_call("open", "open_session", tenant=tenant.config.name,
                                                    body=req.model_dump())
        _raise_for(status, payload)
        self.tenants.session_opened(tenant, payload["session_id"])
        if payload.get("first_token") is not None:
            self.tenants.session_used(tenant, payload["session_id"], 1)
        return payload

    async def verify(self, tenant: TenantState, sid: str, frame: bytes) -> bytes:
        t0 = time.perf_counter()
        self.tenants.check_rate(tenant)
        VerifyFrame.decode(frame, max_nodes=self.cfg.verifier.max_tree_nodes)  # reject garbage before queueing
        status, payload = await self._admitted_call("verify", "verify", session_id=sid, tenant=tenant.config.name,
                                                    frame=frame)
        if status in (404, 410):
            self.tenants.session_gone(tenant, sid)
        _raise_for(status, payload)
        reply = ReplyFrame.decode(payload)
        self.tenants.session_used(tenant, sid, len(reply.accepted) + (reply.bonus is not None))
        self.metrics.on_verify(tenant.config.name, time.perf_counter() - t0, self.admission.inflight)
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
        return await self.info()

    @api.get("/v1/stats")
    async def replica_stats(self, request: Request):
        """One verifier replica's counters (busy seconds, forwards, sessions); ``?session_id=``
        picks the replica of that session; plus this router's admission state. Needs any tenant key."""
        self.tenants.authenticate(request.headers.get("authorization"))
        sid = request.query_params.get("session_id")
        stats = await self._call("get_stats", session_id=sid) if sid else await self._call("get_stats")
        return {**stats, "router_admission": self.admission.snapshot()}

    @api.post("/v1/sessions")
    async def open_session(self, request: Request):
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        return await self.open(tenant, await self._json(request))

    @api.post("/v1/sessions/{sid}/verify")
    async def verify_http(self, sid: str, request: Request):
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        reply = await self.verify(tenant, sid, await self._body(request))
        return Response(reply, media_type="application/octet-stream")

    @api.delete("/v1/sessions/{sid}")
    async def close_session(self, sid: str, request: Request):
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        return await self.close(tenant, sid)

    @api.websocket("/v1/sessions/{sid}/ws")
    async def verify_ws(self, websocket: WebSocket, sid: str):
        """Pipelined rounds on one connection: binary frame in, binary reply (or JSON error) out."""
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
                msg = await websocket.receive()
                if msg.get("type") == "websocket.disconnect":
                    return
                data = msg.get("bytes")
                try:
                    if data is None:
                        raise InvalidRequest("send verify frames as binary messages")
                    if len(data) > self.cfg.router.max_body_bytes:
                        raise PayloadTooLarge("frame too large")
                    await websocket.send_bytes(await self.verify(tenant, sid, data))
                except SpecError as e:
                    router_metrics().on_error(e)
                    payload = {"status": e.status, **e.to_dict()}
                    if isinstance(e, Overloaded):
                        payload["retry_after"] = e.retry_after
                    await websocket.send_text(json.dumps(payload))
        except WebSocketDisconnect:
            return

    # -- OpenAI-compatible server-only modes ------------------------------------------------
    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._openai(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._openai(request, chat=True)

    async def _openai(self, request: Request, chat: bool):
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        body = await self._json(request)
        tok = self.tokenizer()
        prompt, sampling, stream, mode = oai.parse_completion(body, tok, chat)
        info = await self.info()
        drafter = self._server_drafter() if mode == "sd" else None
        gen = self._server_decode(tenant, prompt, sampling, drafter)
        if stream:
            return StreamingResponse(self._sse(gen, tok, info["model"], chat), media_type="text/event-stream")
        ids, finish, stats = [], None, {}
        async for new, finish, stats in gen:
            ids.extend(new)
        stats = {**stats, "token_ids": ids}
        text = tok.decode(ids, skip_special_tokens=True) if tok is not None else ""
        return oai.completion_response(info["model"], text, ids, len(prompt), finish, chat, stats)

    async def _sse(self, gen, tok, model: str, chat: bool):
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        ids: list[int] = []
        sent = ""
        try:
            async for new, finish, _ in gen:
                ids.extend(new)
                text = tok.decode(ids, skip_special_tokens=True) if tok is not None else ""
                if text.endswith("\ufffd") and not finish:  # incomplete UTF-8 sequence: wait for more tokens
                    continue
                delta, sent = text[len(sent):], text
                yield oai.stream_chunk(cid, model, delta, finish, chat)
        except SpecError as e:
            yield f"data: {json.dumps(e.to_dict())}\n\n"
        yield "data: [DONE]\n\n"

    def _server_drafter(self):
        from deploy.router.server_draft import get_server_drafter

        return get_server_drafter(self.cfg)

    async def _server_decode(self, tenant: TenantState, prompt: list[int], sampling: dict, drafter):
        """Server-only decoding through the verifier: AR (empty trees) or with a server drafter.

        Yields (new token ids, finish reason, stats) per round.
        """
        opened = await self.open(tenant, {"prompt_ids": prompt, "sampling": sampling})
        sid, prefix_len = opened["session_id"], opened["prefix_len"]
        history = list(prompt) + [opened["first_token"]]
        rounds, drafted = 0, 0
        try:
            finish = opened.get("finish_reason") if opened["finished"] else None
            yield [opened["first_token"]], finish, {}
            while finish is None:
                # a model drafter computes: keep it off the router's event loop
                tree = (await asyncio.to_thread(drafter.draft, list(history), opened.get("budget_hint") or 8)
                        if drafter else None)
                tokens, parents = (list(tree.tokens), list(tree.parents)) if tree else ([], [])
                frame = VerifyFrame(prefix_len, tokens, parents).encode()
                reply = ReplyFrame.decode(await self.verify(tenant, sid, frame))
                new = [tokens[i] for i in reply.accepted] + ([reply.bonus] if reply.bonus is not None else [])
                history.extend(new)
                prefix_len = reply.prefix_len
                rounds += 1
                drafted += len(tokens)
                finish = reply.finish_reason if reply.finished else None
                yield new, finish, {"rounds": rounds, "draft_tokens": drafted,
                                    "tokens_per_round": (len(history) - len(prompt) - 1) / max(rounds, 1)}
        finally:
            try:
                await self.close(tenant, sid)
            except SpecError:
                pass
