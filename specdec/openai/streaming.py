"""The streaming response both OpenAI servers send (the router's and the edge's ``edge-agent serve``).

Not imported by :mod:`specdec.openai` itself: only the servers need Starlette.
"""

from __future__ import annotations

from starlette.responses import StreamingResponse


class ClosingStream(StreamingResponse):
    """A streaming response that closes its body generator however the response ends: Starlette
    leaves it suspended when the client goes away mid-stream, and with it the session it holds
    (KV, a tenant slot) until the idle timeout."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
