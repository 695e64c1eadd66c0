"""The router's half of early results (the early-exit paper §3, steps 3-4; ``F_EARLY``).

A Serve streaming call (``Verifier.verify_stream``): early frames go to the edge as they come, the reply last."""

from __future__ import annotations

from typing import Awaitable, Callable

Send = Callable[[bytes], Awaitable[None]]


async def stream_verify(handle, method: str, send: Send, kwargs: dict) -> tuple[int, bytes | dict]:
    """Forward the early frames of the streaming call ``handle.<method>`` to ``send``; return ``(status, payload)``."""
    gen = getattr(handle.options(stream=True), method).remote(**kwargs)
    async for item in gen:
        if item[0] == "early":
            await send(item[1])
        else:
            return item[1], item[2]
    return 503, {"error": {"code": "verifier_unavailable", "message": "the verifier's stream ended without a reply"}}
