"""Request bodies at the router: read bounded in size and time, parsed as strict JSON.

:func:`read_body` answers 413 (too large) or 408 (late); :func:`parse_json` refuses NaN/Infinity and deep nesting."""

from __future__ import annotations

import asyncio
import json

from specdec.errors import InvalidRequest, PayloadTooLarge, RequestTimeout


async def within(aw, seconds: float):
    """``await aw``, raising ``asyncio.TimeoutError`` after ``seconds`` (docs/router.md, "The ingress")."""
    if not hasattr(asyncio, "timeout"):  # Python 3.10
        return await asyncio.wait_for(aw, seconds)
    async with asyncio.timeout(seconds):
        return await aw


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The body of ``request`` (a Starlette request): at most ``max_bytes``, within ``timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise InvalidRequest("Content-Length must be a number of bytes")
    if declared is not None and int(declared) > max_bytes:
        raise PayloadTooLarge(f"a body of {declared} bytes exceeds {max_bytes}")
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLarge(f"the body exceeds {max_bytes} bytes")
            chunks.append(chunk)

    try:
        await within(read(), timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    return b"".join(chunks)


def _no_constants(name: str):
    raise InvalidRequest(f"body is not valid JSON: {name} is not a JSON number")


def parse_json(body: bytes):
    """Strict JSON: no NaN/Infinity (Python's json accepts them), no recursion blow-up."""
    try:
        return json.loads(body or b"null", parse_constant=_no_constants)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("body is not valid JSON: nested too deeply") from None


def json_object(body: bytes) -> dict:
    """:func:`parse_json` of a body that must be a JSON object."""
    data = parse_json(body)
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object")
    return data
