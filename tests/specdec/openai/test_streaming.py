"""The servers' streaming response (specdec/openai/streaming.py): its body generator is closed
however the response ends, a client gone mid-stream included."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import StreamingResponse

from specdec.openai.streaming import ClosingStream


def test_the_body_is_closed_when_the_client_goes_mid_stream():
    closed = []

    async def body():
        try:
            for i in range(10):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            raise OSError("client gone")

    async def receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "GET", "path": "/",
             "headers": []}
    async def main(cls):
        with pytest.raises(Exception):  # Starlette reports the disconnect its own way
            await cls(body(), media_type="text/event-stream")(scope, receive, send)
        return list(closed)  # before the event loop closes leftover generators itself

    assert asyncio.run(main(ClosingStream)) == [True]
    closed.clear()
    assert asyncio.run(main(StreamingResponse)) == []  # what it is for: Starlette's own leaves it suspended
