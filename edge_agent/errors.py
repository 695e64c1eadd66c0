"""Edge-side errors (the server's typed errors are :mod:`specdec.errors`)."""

from __future__ import annotations

from specdec.errors import SpecError


class EdgeError(Exception):
    """Base class of errors the edge agent raises itself."""


class ServerUnreachable(EdgeError):
    """No connection could be made (wrong URL, server down, firewall)."""


class ConnectionLost(EdgeError):
    """A request was sent but its reply never came (timeout, reset): its effect is unknown.

    The agent recovers by re-opening the session from its token history.
    """


def error_from_json(status: int, body: dict | None, retry_after: float | None = None) -> SpecError:
    """Rebuild the server's typed error from its JSON body (``{"error": {"code", "message"}}``)."""
    from specdec import errors as E

    err = (body or {}).get("error") if isinstance(body, dict) else None
    code = (err or {}).get("code", "")
    message = (err or {}).get("message", f"HTTP {status}")
    details = {k: v for k, v in (err or {}).items() if k not in ("code", "message", *E.DERIVED_FIELDS)}

    def subclasses(c):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)

    for cls in subclasses(E.SpecError):
        if getattr(cls, "code", None) == code and cls.__dict__.get("code") == code:
            if cls is E.Overloaded:
                ra = float(details.pop("retry_after", retry_after if retry_after is not None else 1.0))
                return E.Overloaded(message, retry_after=ra, **details)
            return cls(message, **details)
    e = E.SpecError(message, **details)
    e.status, e.code = status, code or f"http_{status}"
    return e


class CloudUnavailable(SpecError):
    """``edge-agent serve``: the cloud server could not be reached, or broke off a generation."""

    status, code = 503, "cloud_unavailable"
