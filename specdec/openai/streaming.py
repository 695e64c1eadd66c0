"""The streaming response both OpenAI servers send (router, ``edge-agent serve``); only they import Starlette."""

from __future__ import annotations

from starlette.responses import StreamingResponse


class ClosingStream(StreamingResponse):
    """A streaming response that closes its body generator however the response ends (why: docs/specdec.md)."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
