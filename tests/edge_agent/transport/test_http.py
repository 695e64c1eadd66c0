"""HttpTransport: WebSocket by default with a fall-back to POST, a proxy's bare 5xx as a lost reply;
and the edge install staying free of Ray and Serve."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from specdec import errors as E
from specdec.protocol import OpenSession, VerifyFrame


def test_edge_agent_imports_no_ray_or_serve():
    code = ("import sys, edge_agent.cli, edge_agent.agent, edge_agent.transport, edge_agent.draft_session; "
            "bad = [m for m in ('ray', 'fastapi', 'starlette') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_websocket_is_the_default_and_falls_back_to_post_where_the_upgrade_is_refused():
    """A proxy without WebSocket support answers the upgrade with a plain 404 page: the
    transport then verifies over POST (and stays there)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from specdec.protocol import ReplyFrame
    from edge_agent.transport import HttpTransport

    reply = ReplyFrame([0], 7, 12).encode()

    class NoWebSockets(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # the WebSocket upgrade
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", "22")
            self.end_headers()
            self.wfile.write(b"<html>not found</html>")

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NoWebSockets)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def main():
        async with HttpTransport(f"http://127.0.0.1:{server.server_address[1]}") as t:
            assert t.ws  # the default
            first = await t.verify("s", VerifyFrame(10, [5], [-1]))  # over POST while the socket opens
            assert not await t.socket_ready("s") and not t.ws
            return first, await t.verify("s", VerifyFrame(12, [5], [-1]))

    try:
        first, second = asyncio.run(main())
    finally:
        server.shutdown()
    assert first.bonus == 7 and first.accepted == [0] and second.prefix_len == 12


def test_a_proxys_bare_5xx_is_a_lost_reply_and_an_app_error_is_not():
    """Serve's proxy answers a request whose replica died with a plain-text 500 (topology colocated:
    the router's replica): a verify raises ConnectionLost (the agent re-opens from its history), an
    open is retried; the app's own JSON 500 stays the app's error."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from edge_agent.errors import ConnectionLost
    from edge_agent.transport import HttpTransport, RetryPolicy

    opened = json.dumps({"session_id": "r.1", "prefix_len": 3, "first_token": 5, "finished": False, "depth_hint": 4,
                         "budget_hint": 8, "tokenizer_fingerprint": "x", "model": "m"}).encode()
    app_error = json.dumps({"error": {"code": "internal", "message": "boom"}}).encode()
    seen = {"opens": 0}

    class DyingReplica(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self, status: int, body: bytes, ctype: str):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/sessions":
                seen["opens"] += 1
                if seen["opens"] == 1:
                    return self.answer(500, b"Internal Server Error", "text/plain")
                return self.answer(200, opened, "application/json")
            if self.path.startswith("/v1/sessions/app"):
                return self.answer(500, app_error, "application/json")
            self.answer(500, b"Internal Server Error", "text/plain")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), DyingReplica)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def main():
        url = f"http://127.0.0.1:{server.server_address[1]}"
        async with HttpTransport(url, ws=False, retry=RetryPolicy(backoff_s=0.01)) as t:
            s = await t.open(OpenSession(prompt_ids=[1, 2, 3]))
            assert s.session_id == "r.1" and seen["opens"] == 2  # retried past the bare 500
            with pytest.raises(ConnectionLost):
                await t.verify("r.1", VerifyFrame(3, [5], [-1]))
            with pytest.raises(E.SpecError) as e:
                await t.verify("app.1", VerifyFrame(3, [5], [-1]))
            assert not isinstance(e.value, ConnectionLost) and e.value.code == "internal"

    try:
        asyncio.run(main())
    finally:
        server.shutdown()
