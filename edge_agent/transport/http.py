"""The real server over HTTP: an ``httpx.AsyncClient`` with keep-alive (a verify round is one
request on a warm connection: one RTT), or one WebSocket per session (``ws=True``, the default).
Notes: docs/edge_agent.md, "edge_agent/transport/http.py"."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass, field

from edge_agent.errors import ConnectionLost, ServerUnreachable, error_from_json
from edge_agent.transport.base import ModelInfo, Transport
from specdec import clock
from specdec.errors import SessionEvicted, SessionNotFound, SpecError
from specdec.protocol import (EARLY_STREAM_MEDIA_TYPE, EarlyFrame, OpenSession, RecordReader, ReplyFrame, SessionOpened,
                              VerifyFrame)

log = logging.getLogger("edge_agent")


@dataclass
class RetryPolicy:
    attempts: int = 4  # tries per call (first one included)
    backoff_s: float = 0.2  # first wait; doubles each time, with jitter
    max_backoff_s: float = 5.0
    max_retry_after_s: float = 30.0  # the longest Retry-After we honour

    def wait(self, attempt: int) -> float:
        b = min(self.backoff_s * (2 ** attempt), self.max_backoff_s)
        return b * (0.5 + random.random() / 2)


@dataclass
class HttpTransport(Transport):
    """The real server. ``base_url`` like ``http://host:port`` (endpoints under ``/v1``)."""

    base_url: str
    api_key: str | None = None
    # verify over a per-session WebSocket (the default: x0.58 the server CPU per round of POST, in every
    # hop; `python -m benchmarks.request_path`); falls back to POST where the upgrade is refused
    ws: bool = True
    # POST rounds with F_EARLY (only an agent that pre-drafts sets it) accept the streamed response: early
    # frames, then the reply (specdec/protocol.py); off: the flag is served as a plain reply, no early frames
    stream_early: bool = True
    timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self):
        import httpx

        self.base_url = self.base_url.rstrip("/")
        headers = {"User-Agent": "specedge-edge-agent/0.1"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        self._headers = headers
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers,
            timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
            limits=httpx.Limits(max_keepalive_connections=8, keepalive_expiry=60.0))
        self._ws: dict[str, object] = {}
        self._connecting: dict[str, asyncio.Task] = {}  # sockets being opened (their first rounds go over POST)
        self._closing: set[asyncio.Task] = set()  # closing handshakes of released and closed sessions' sockets

    async def aclose(self) -> None:
        for sid in set(self._ws) | set(self._connecting):
            await self._close_ws(sid)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        await self._client.aclose()

    async def _request(self, method: str, path: str, *, idempotent: bool, **kw):
        """One HTTP call with retries; returns the response of a 2xx, raises otherwise."""
        import httpx

        last: Exception | None = None
        for attempt in range(self.retry.attempts):
            try:
                r = await self._client.request(method, path, **kw)
            except httpx.ConnectError as e:  # never reached the server: always safe to retry
                last = ServerUnreachable(f"cannot reach {self.base_url}: {e}")
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                if isinstance(e, httpx.ConnectTimeout):
                    last = ServerUnreachable(f"cannot reach {self.base_url}: connect timed out")
                elif not idempotent:
                    raise ConnectionLost(f"{method} {path}: {type(e).__name__}: {e}") from None
                else:
                    last = ConnectionLost(f"{method} {path}: {type(e).__name__}: {e}")
            else:
                if r.status_code < 400:
                    return r
                try:
                    body = r.json()
                except (json.JSONDecodeError, ValueError):
                    body = None
                if r.status_code >= 500 and not is_app_error(body):
                    # not the app's JSON error: a proxy answering for a replica that went away mid-request
                    # (topology colocated: the replica holding the router died); the reply is lost
                    lost = ConnectionLost(f"{method} {path}: HTTP {r.status_code} without the server's error body")
                    if not idempotent:
                        raise lost
                    last = lost
                    if attempt + 1 < self.retry.attempts:
                        await clock.sleep(self.retry.wait(attempt))
                    continue
                ra = r.headers.get("Retry-After")
                err = error_from_json(r.status_code, body, float(ra) if ra else None)
                if r.status_code == 429 and isinstance(err, SpecError):
                    wait = getattr(err, "retry_after", None) or (float(ra) if ra else 1.0)
                    if attempt + 1 < self.retry.attempts and wait <= self.retry.max_retry_after_s:
                        await clock.sleep(wait)
                        last = err
                        continue
                    raise err
                if r.status_code in (502, 503, 504) and attempt + 1 < self.retry.attempts:
                    last = err
                    await clock.sleep(self.retry.wait(attempt))
                    continue
                raise err
            if attempt + 1 < self.retry.attempts:
                await clock.sleep(self.retry.wait(attempt))
        assert last is not None
        raise last

    async def model_info(self) -> ModelInfo:
        r = await self._request("GET", "/v1/model", idempotent=True)
        return ModelInfo.from_dict(r.json())

    async def open(self, req: OpenSession) -> SessionOpened:
        # not idempotent strictly, but a duplicate session is harmless (idle-evicted)
        r = await self._request("POST", "/v1/sessions", idempotent=True, content=req.model_dump_json(),
                                headers={"Content-Type": "application/json"})
        return SessionOpened.model_validate(r.json())

    async def verify(self, sid: str, frame: VerifyFrame, on_early=None) -> ReplyFrame:
        conn = self._socket(sid) if self.ws else None
        if conn is not None:
            return await self._verify_ws(sid, conn, frame, on_early)
        if frame.early and on_early is not None and self.stream_early:
            return await self._verify_post_streamed(sid, frame, on_early)
        r = await self._request("POST", f"/v1/sessions/{sid}/verify", idempotent=False, content=frame.encode(),
                                headers={"Content-Type": "application/octet-stream"})
        return ReplyFrame.decode(r.content)

    async def _verify_post_streamed(self, sid: str, frame: VerifyFrame, on_early) -> ReplyFrame:
        """POST an ``F_EARLY`` frame accepting the streamed response: ``on_early`` gets each early
        frame as its record arrives; the last record is the reply or an error (JSON). A server
        that answers with a plain reply (no stream) is read as one. No retries (a verify is not
        idempotent), as over the socket."""
        import httpx

        path = f"/v1/sessions/{sid}/verify"
        headers = {"Content-Type": "application/octet-stream", "Accept": EARLY_STREAM_MEDIA_TYPE}
        try:
            async with self._client.stream("POST", path, content=frame.encode(), headers=headers) as r:
                if r.status_code >= 400 or not r.headers.get("content-type", "").startswith(EARLY_STREAM_MEDIA_TYPE):
                    await r.aread()
                    if r.status_code < 400:
                        return ReplyFrame.decode(r.content)
                    try:
                        body = r.json()
                    except (json.JSONDecodeError, ValueError):
                        body = None
                    ra = r.headers.get("Retry-After")
                    raise error_from_json(r.status_code, body, float(ra) if ra else None)
                reader = RecordReader()
                async for chunk in r.aiter_raw():
                    for msg in reader.feed(chunk):
                        if EarlyFrame.is_early(msg):
                            on_early(EarlyFrame.decode(msg))
                        elif msg[:1] == b"{":
                            _raise_json_error(msg.decode())
                        else:
                            return ReplyFrame.decode(msg)
        except httpx.ConnectError as e:
            raise ServerUnreachable(f"cannot reach {self.base_url}: {e}") from None
        except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
            raise ConnectionLost(f"POST {path}: {type(e).__name__}: {e}") from None
        raise ConnectionLost(f"POST {path}: the stream ended before the reply")

    async def close(self, sid: str) -> None:
        """End the session on the server; its socket's closing handshake runs beside the DELETE, so a
        socket slow to close (a reply still on its way) never keeps the session's KV held."""
        await self.release(sid)
        try:
            await self._request("DELETE", f"/v1/sessions/{sid}", idempotent=True)
        except (SessionNotFound, SessionEvicted):
            pass

    async def ping(self) -> float:
        t0 = clock.perf_counter()
        await self._request("GET", "/v1/health", idempotent=True)
        return clock.perf_counter() - t0

    # -- WebSocket ------------------------------------------------------------------------
    def _ws_url(self, sid: str) -> str:
        base = self.base_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        return f"{base}/v1/sessions/{sid}/ws"

    async def release(self, sid: str) -> None:
        # a socket's closing handshake is a round trip: it runs beside the next open, not before it
        self._stop_connecting(sid)
        conn = self._ws.pop(sid, None)
        if conn is not None:
            self._in_background(_close_socket(conn))

    async def _close_ws(self, sid: str) -> None:
        self._stop_connecting(sid)
        conn = self._ws.pop(sid, None)
        if conn is not None:
            await _close_socket(conn)

    def _in_background(self, coro) -> None:
        """A socket's closing, or a cancelled opening: :meth:`aclose` awaits what is left of them."""
        task = asyncio.ensure_future(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _stop_connecting(self, sid: str) -> None:
        task = self._connecting.pop(sid, None)
        if task is None:
            return
        if not task.done():
            task.cancel()
            self._in_background(task)
        elif (conn := _opened(task)) is not None:  # it opened, unused: close it
            self._in_background(_close_socket(conn))

    def _socket(self, sid: str):
        """The session's open WebSocket, or None: this round goes over POST. A session's first
        round starts the upgrade and goes over POST on the warm keep-alive connection, so the
        upgrade's round trip is not on the session's path (measured at RTT 100 ms: every
        generation's first round took 210 ms instead of 110); later rounds take the socket
        once it is open."""
        conn = self._ws.get(sid)
        if conn is not None:
            return conn
        task = self._connecting.get(sid)
        if task is None:
            self._connecting[sid] = asyncio.create_task(self._connect(sid))
            return None
        if not task.done():
            return None
        del self._connecting[sid]
        conn = _opened(task)
        if conn is not None:
            self._ws[sid] = conn
        return conn

    async def socket_ready(self, sid: str) -> bool:
        """Wait for the session's WebSocket, which its first round began to open; whether the
        session's rounds now go over it."""
        task = self._connecting.get(sid)
        if task is not None:
            await asyncio.wait({task})
            self._socket(sid)  # takes the socket it opened
        return sid in self._ws

    async def _connect(self, sid: str):
        """Open the session's WebSocket; None when it cannot be (the next round tries again). A
        server that does not speak WebSocket there (a proxy refusing the upgrade) turns the
        transport to POST for good; the server's own refusal (an unknown session, a bad key)
        the POST round meets as well."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidHandshake, InvalidStatus, WebSocketException

        try:
            conn = await asyncio.wait_for(
                # permessage-deflate stays offered: without it the server's CPU per round did not
                # measurably fall and the bytes per token rose 18-30 % (benchmarks/results/README.md)
                connect(self._ws_url(sid), additional_headers=self._headers, max_size=1 << 22,
                        open_timeout=self.connect_timeout_s), self.connect_timeout_s + 1)
        except InvalidStatus as e:
            resp = e.response
            try:
                body = json.loads(bytes(resp.body or b"").decode() or "null")
            except (ValueError, UnicodeDecodeError):
                body = None
            if not (isinstance(body, dict) and "error" in body):  # not our server's refusal: no WebSockets
                self._fall_back_to_post(f"HTTP {resp.status_code}")
            return None
        except InvalidHandshake as e:  # an HTTP server that does not speak WebSocket here
            self._fall_back_to_post(str(e))
            return None
        except (OSError, asyncio.TimeoutError, WebSocketException) as e:
            log.debug("cannot open a WebSocket to %s: %s", self._ws_url(sid), e)
            return None
        return conn

    def _fall_back_to_post(self, why: str) -> None:
        if self.ws:
            log.warning("WebSocket upgrade refused (%s): verifying over HTTP POST from now on", why)
        self.ws = False

    async def _verify_ws(self, sid: str, conn, frame: VerifyFrame, on_early=None) -> ReplyFrame:
        from websockets.exceptions import ConnectionClosed

        try:
            await conn.send(frame.encode())
            msg = await asyncio.wait_for(conn.recv(), self.timeout_s)
            while isinstance(msg, bytes) and EarlyFrame.is_early(msg):  # early results precede the reply
                if on_early is not None:
                    on_early(EarlyFrame.decode(msg))
                msg = await asyncio.wait_for(conn.recv(), self.timeout_s)
        except (ConnectionClosed, OSError, asyncio.TimeoutError) as e:
            await self._close_ws(sid)
            raise ConnectionLost(f"WebSocket verify: {type(e).__name__}: {e}") from None
        if isinstance(msg, str):  # an error arrives as a JSON text frame
            _raise_json_error(msg)
        return ReplyFrame.decode(msg)


def _opened(task: asyncio.Task):
    """The socket a finished opening task gave, or None (cancelled, failed)."""
    if task.cancelled():
        return None
    if task.exception() is not None:
        log.debug("opening a WebSocket failed: %r", task.exception())
        return None
    return task.result()


async def _close_socket(conn) -> None:
    try:
        await conn.close()
    except Exception:  # noqa: BLE001 - closing a broken socket
        pass


def is_app_error(body) -> bool:
    """Whether a response body is the app's own error (``{"error": {"code", ...}}``)."""
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and "code" in body["error"]


def _raise_json_error(text: str) -> None:
    """An error sent in-band (a WebSocket text frame, a streamed POST's last record):
    ``{"status": ..., "error": {...}, "retry_after": ...}``."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    status = int(body.get("status", 400)) if isinstance(body, dict) else 400
    raise error_from_json(status, body, body.get("retry_after") if isinstance(body, dict) else None)
