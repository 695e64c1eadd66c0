"""``edge-agent serve``: a long-running local OpenAI server whose generations are drafted here
and verified by the cloud (docs/protocol.md, "One generation, end to end", steps 1-6, per request).
Notes: docs/edge_agent.md, "edge_agent/server.py"."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, replace

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_executor import DraftExecutor
from edge_agent.errors import CloudUnavailable, ConnectionLost, EdgeError, ServerUnreachable
from edge_agent.metrics import EdgeMetrics
from edge_agent.transport.base import ModelInfo, Transport
from specdec import clock
from specdec import openai as oai
from specdec.errors import InvalidRequest, Overloaded, SpecError
from specdec.openai.streaming import ClosingStream

log = logging.getLogger("edge_agent.server")

MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
GRACEFUL_S = 5  # at SIGTERM, how long generations in flight may finish before they are cancelled


def new_drafter_like(drafter):
    """A drafter of the same kind sharing ``drafter``'s weights (its own KV cache and state)."""
    from edge_agent.draft_backends import ModelDrafter

    if isinstance(drafter, ModelDrafter):
        return ModelDrafter(drafter.model, vocab_map=drafter.vocab_map, name=drafter.name)
    return type(drafter)()  # prompt lookup, no draft: stateless to build


class AgentPool:
    """Idle :class:`EdgeAgent` s over one draft; a request takes one, or builds one while fewer
    than ``max_agents`` exist, else waits for one to come back."""

    def __init__(self, transport: Transport, drafter, tokenizer, config: AgentConfig, max_agents: int):
        self.transport, self.tokenizer, self.config, self.max_agents = transport, tokenizer, config, max_agents
        self._first = drafter
        self.executor = DraftExecutor(name="edge-serve-drafts")
        self._idle: asyncio.Queue[EdgeAgent] = asyncio.Queue()
        self.members: list[EdgeAgent] = []  # every agent built, idle or busy
        self.busy = 0

    @property
    def agents(self) -> int:
        return len(self.members)

    async def acquire(self) -> EdgeAgent:
        if self._idle.empty() and self.agents < self.max_agents:
            drafter = self._first if not self.members else new_drafter_like(self._first)
            agent = EdgeAgent(self.transport, drafter, self.tokenizer, replace(self.config),
                              draft_executor=self.executor)
            self.members.append(agent)
        else:
            agent = await self._idle.get()
        self.busy += 1
        return agent

    def release(self, agent: EdgeAgent) -> None:
        self.busy -= 1
        self._idle.put_nowait(agent)

    @property
    def draft_name(self) -> str:
        return getattr(self._first, "name", type(self._first).__name__)

    def close(self) -> None:
        self.executor.shutdown()


def openai_error(e: BaseException) -> SpecError:
    """What the local client is told: the cloud's typed error as it came, or what went wrong on the way."""
    if isinstance(e, SpecError) and not e.code.startswith("http_"):
        return e
    if isinstance(e, SpecError):  # an HTTP error without the app's error body: no app answers there
        return CloudUnavailable(f"the cloud server answered HTTP {e.status} without the app's error: {e.message}")
    if isinstance(e, ServerUnreachable):
        return CloudUnavailable(f"the cloud server cannot be reached: {e}")
    if isinstance(e, (ConnectionLost, EdgeError, OSError)):
        return CloudUnavailable(f"the cloud server broke off the generation: {e}")
    raise e


def error_response(e: SpecError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_header)} if isinstance(e, Overloaded) else None
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)


async def _prepend(first, rest):
    """``first``, then the items of the async generator ``rest`` (closed with this one)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


@dataclass
class EdgeServer:
    """The local OpenAI server: ``app`` is the ASGI application."""

    pool: AgentPool
    info: ModelInfo
    metrics: EdgeMetrics
    cloud_url: str = ""

    def __post_init__(self):
        self.created = int(clock.wall())
        routes = [Route("/v1/models", self.models), Route("/v1/models/{model:path}", self.model_card),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/health", self.health), Route("/v1/health", self.health),
                  Route("/metrics", self.prometheus)]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    @property
    def tokenizer(self):
        return self.pool.tokenizer

    # -- plain endpoints ------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse(oai.model_list(self.info.model, self.created))

    async def model_card(self, request: Request) -> Response:
        model = request.path_params["model"]
        try:
            oai.check_model(model, (self.info.model,))
        except SpecError as e:
            return error_response(e)
        return JSONResponse(oai.model_card(model, self.created))

    async def health(self, request: Request) -> Response:
        agents = self.pool.members
        return JSONResponse({"status": "ok", "model": self.info.model, "cloud": self.cloud_url,
                             "draft": self.pool.draft_name,
                             "agents": len(agents), "running": self.pool.busy,
                             # what the agents share: the draft's weights (models) and the draft thread
                             "draft_models": len({id(getattr(a.drafter, "model", a.drafter)) for a in agents}),
                             "draft_executors": len({id(a._drafts) for a in agents})})

    async def prometheus(self, request: Request) -> Response:
        import prometheus_client as pc

        return Response(pc.generate_latest(self.metrics.registry), media_type=pc.CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        self.pool.close()  # after uvicorn's graceful shutdown: every generation has ended
        await self.pool.transport.aclose()

    # -- generations ----------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            req = self._parse(await request.body(), chat)
            rounds = self._rounds(req)
            first = await anext(rounds)  # the open: a refused request gets its own status, not a stream
        except SpecError as e:
            self.metrics.on_request(endpoint, e.status)
            return error_response(e)
        deltas = oai.texts(_prepend(first, rounds), self.tokenizer, req.stop, req.tools)
        headers = {oai.IGNORED_FIELDS_HEADER: ", ".join(req.ignored)} if req.ignored else None
        if req.ignored:
            log.warning(oai.ignored_warning(req.ignored))
        model = req.model or self.info.model
        self.metrics.on_request(endpoint, 200)
        if req.stream:
            return ClosingStream(oai.sse(deltas, req, model, self.tokenizer), media_type="text/event-stream",
                                  headers=headers)
        task = asyncio.ensure_future(oai.whole_response(deltas, req, model, self.tokenizer))
        try:
            while not task.done():  # a client that goes away cancels its generation
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)  # nginx's "client closed request": nobody reads it
            return JSONResponse(task.result(), headers=headers)
        except SpecError as e:
            return error_response(e)
        finally:
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await deltas.aclose()

    def _parse(self, body: bytes, chat: bool) -> oai.CompletionRequest:
        if len(body) > MAX_BODY_BYTES:
            raise InvalidRequest(f"the body exceeds {MAX_BODY_BYTES} bytes")
        try:
            data = json.loads(body or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"body is not valid JSON: {e}") from None
        req = oai.parse_completion(data, self.tokenizer, chat)
        if self.info.max_model_len is not None:
            req = req.with_max_tokens(self.info.max_model_len)
        elif req.sampling["max_tokens"] is None:
            req = replace(req, sampling={k: v for k, v in req.sampling.items() if k != "max_tokens"})
        oai.check_sampling(req.sampling, self.info.vocab_size)
        return req

    async def _rounds(self, req: oai.CompletionRequest):
        """The request's generation as :class:`~specdec.openai.Round` s: the first carries the first
        token (or raises the open's error, as an OpenAI error); the generation is cancelled, and its cloud
        session closed, when this generator is closed early."""
        agent = await self.pool.acquire()
        self.metrics.set_running(self.pool.busy)
        agent.config.model = None if req.model in (None, "base", self.info.model) else req.model  # a target version
        queue: asyncio.Queue = asyncio.Queue()
        logprobs: list = []

        def on_tokens(toks: list[int]) -> None:
            queue.put_nowait(oai.Round(list(toks), None, {}, list(logprobs) if req.logprobs is not None else None))
            logprobs.clear()

        async def run() -> None:
            try:
                res = await agent.generate(req.prompt, dict(req.sampling), on_tokens=on_tokens,
                                           on_logprobs=logprobs.extend, grammar=req.grammar)
                self.metrics.observe(res.stats)
                queue.put_nowait(oai.Round([], res.stats.finish_reason or "length", res.stats.to_dict()))
            except Exception as e:  # noqa: BLE001 - handed to the request, which answers it
                queue.put_nowait(e)

        task = asyncio.ensure_future(run())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise openai_error(item)
                yield item
                if item.finish is not None:
                    return
        finally:
            if not task.done():
                task.cancel()  # the agent's own cleanup closes the cloud session, in that task
            # the agent goes back to the pool once its generation (cleanup included) has ended; nothing
            # awaited here: a cancelled client's stream may be cancelled again at every await
            task.add_done_callback(lambda _t: self._release(agent))

    def _release(self, agent: EdgeAgent) -> None:
        self.pool.release(agent)
        self.metrics.set_running(self.pool.busy)


async def serve(app, host: str, port: int, announce) -> None:
    """Serve ``app`` on ``host:port`` (0: a free port) until SIGTERM / SIGINT, then shut down gracefully
    (requests in flight get ``GRACEFUL_S``); ``announce(host, port)`` once the socket listens."""
    import socket

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:  # uvicorn re-raises a handled signal after the shutdown: the exit is clean, status 0
                    self._captured_signals.clear()

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections wait in the backlog until uvicorn takes them
    announce(*sock.getsockname()[:2])
    await Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_S)).serve(sockets=[sock])
