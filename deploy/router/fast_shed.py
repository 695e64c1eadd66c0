"""Shedding before FastAPI: a pure-ASGI fast path for the requests admission control refuses.

:class:`ShedFastPath` answers a refusal before routing, the body never read; everything else, a bad key included,
goes on to the app unchanged. Why: docs/router.md, "Shedding before routing"."""

from __future__ import annotations

import json
from collections.abc import Callable

from specdec import clock
from specdec.errors import Overloaded, SpecError

RECEIVED_AT = "specedge.received_at"  # scope key: perf_counter() when a POST reached the fast path


def shed_kind(method: str, path: str) -> str | None:
    """The admission kind of a request the fast path may shed: ``POST /v1/sessions`` opens,
    ``POST /v1/sessions/{id}/verify`` verifies; anything else None (never shed before routing)."""
    if method != "POST":
        return None
    if path == "/v1/sessions":
        return "open"
    if path.startswith("/v1/sessions/") and path.endswith("/verify") and path.count("/") == 4 and len(path) > 20:
        return "verify"
    return None


def admission_refusal(method: str, path: str, authorization: str | None, tenants, admission) -> Overloaded | None:
    """The 429 admission control gives now to a sheddable request, or None (not sheddable, or a bad key: 401 later)."""
    kind = shed_kind(method, path)
    if kind is None:
        return None
    try:
        tenant = tenants.authenticate(authorization)
    except SpecError:
        return None
    return admission.refusal(tenant.config.name, kind)


def error_response(e: Overloaded) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and body of a shed answer, byte for byte what the app's error handler sends."""
    body = json.dumps(e.to_dict(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    return e.status, [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json"),
                      (b"retry-after", str(e.retry_after_header).encode())], body


class ShedFastPath:
    """ASGI middleware: ``decide(method, path, authorization) -> Overloaded | None`` before routing;
    ``on_shed(seconds)``: the server-side time of each answer it gave (entry to the body sent)."""

    def __init__(self, app, decide: Callable[[str, str, str | None], Overloaded | None],
                 on_shed: Callable[[Overloaded, float], None] | None = None):
        self.app = app
        self.decide = decide
        self.on_shed = on_shed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        t0 = clock.perf_counter()
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        auth = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                auth = v.decode("latin-1")
                break
        refused = self.decide("POST", path, auth)
        if refused is None:
            scope[RECEIVED_AT] = t0  # the app's own 429s (quotas, rate limits) are timed from here too
            return await self.app(scope, receive, send)
        status, headers, body = error_response(refused)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        if self.on_shed is not None:
            self.on_shed(refused, clock.perf_counter() - t0)
