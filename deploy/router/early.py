"""The router's half of early results (the early-exit paper §3, steps 3-4; ``F_EARLY``).

A WebSocket verify frame with ``F_EARLY`` (or a POST one that accepts the streamed response,
``Router._verify_streamed``) becomes a Serve *streaming* call to the session's replica
(``Verifier.verify_stream``): every early frame it yields mid-forward is written to the
edge's socket (or response) as it arrives, and the stream's last item is the round's reply
(status, payload), handled exactly like a plain verify call's.
"""

from __future__ import annotations

from typing import Awaitable, Callable

Send = Callable[[bytes], Awaitable[None]]


async def stream_verify(handle, method: str, send: Send, kwargs: dict) -> tuple[int, bytes | dict]:
    """Forward the early frames of ``handle.<method>`` (a streaming call) to ``send``; return
    the final ``(status, payload)``."""
    gen = getattr(handle.options(stream=True), method).remote(**kwargs)
    async for item in gen:
        if item[0] == "early":
            await send(item[1])
        else:
            return item[1], item[2]
    return 503, {"error": {"code": "verifier_unavailable", "message": "the verifier's stream ended without a reply"}}
