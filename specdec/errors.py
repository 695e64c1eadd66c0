"""Typed errors shared by the engine, the router and the wire decoder: each a ``SpecError`` with an
HTTP ``status`` and a stable ``code`` (the router's JSON 4xx, the CLI's one-line message). Pure module."""

from __future__ import annotations


class SpecError(Exception):
    """Base class: ``status`` is the HTTP status, ``code`` a stable string for clients."""

    status: int = 400
    code: str = "bad_request"

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details

    @property
    def type(self) -> str:
        """OpenAI's error ``type`` for this status."""
        return ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def to_dict(self) -> dict:
        """OpenAI's error object (``message``, ``type``, ``param``, ``code``) plus this error's details."""
        return {"error": {"message": self.message, "type": self.type, "param": self.details.get("param"),
                          "code": self.code, **self.details}}


# OpenAI's error types by HTTP status (what its clients and vLLM's answer carry)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error"}
DERIVED_FIELDS = ("type", "param")  # of to_dict's error object: not details when an error is rebuilt from JSON


class InvalidRequest(SpecError):
    status, code = 400, "invalid_request"


class InvalidTree(InvalidRequest):
    """The draft tree is malformed (parents, sizes, depth, token ids)."""

    code = "invalid_tree"


class InvalidSamplingParams(InvalidRequest):
    code = "invalid_sampling_params"


class TokenizerMismatch(InvalidRequest):
    """The edge's draft tokenizer differs from the target's (fingerprints differ)."""

    code = "tokenizer_mismatch"

    @classmethod
    def check(cls, edge: str | None, target: str) -> None:
        """Raise unless the edge's fingerprint (None: not sent) is the target's."""
        if edge and edge != target:
            raise cls(f"tokenizer mismatch: the edge's tokenizer {edge} differs from the target's {target}")


class PrefixMismatch(SpecError):
    """The edge assumed a different verified prefix length than the session has."""

    status, code = 409, "prefix_mismatch"


class Unauthorized(SpecError):
    status, code = 401, "unauthorized"


class Forbidden(SpecError):
    status, code = 403, "forbidden"


class SessionNotFound(SpecError):
    status, code = 404, "session_not_found"


class SessionEvicted(SpecError):
    """The server dropped the session's KV cache; the edge re-opens it from its history."""

    status, code = 410, "session_evicted"


class SessionFinished(SpecError):
    status, code = 409, "session_finished"


class Overloaded(SpecError):
    """Load shedding: the client should retry after ``retry_after`` seconds."""

    status, code = 429, "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0, reason: str = "queue_full", **details):
        super().__init__(message, retry_after=retry_after, reason=reason, **details)
        self.retry_after = retry_after
        self.reason = reason

    @property
    def retry_after_header(self) -> int:
        """The Retry-After header's value: whole seconds, at least 1 (RFC 9110 takes no fractions)."""
        return max(1, round(self.retry_after))


class PayloadTooLarge(SpecError):
    status, code = 413, "payload_too_large"


class RequestTimeout(SpecError):
    """The client sent its request body too slowly (or a WebSocket stayed idle too long)."""

    status, code = 408, "request_timeout"


class KVStateLost(SpecError):
    """A batch's KV commit failed (a pipeline stage): its sessions are dropped and answer ``410`` from then on."""

    status, code = 503, "kv_state_lost"

    def __init__(self, message: str, sessions=()):
        super().__init__(message)
        self.sessions = tuple(sessions)  # not in the reply: other tenants' session ids


class UpstreamTimeout(SpecError):
    """The verifier did not answer within ``router.request_timeout_s``."""

    status, code = 504, "timeout"


class KVCapacityExceeded(SpecError):
    """The replica's KV pool has no free pages for this request right now (retry, or evict)."""

    status, code = 503, "kv_capacity"


class UnsupportedModel(ValueError):
    """A target/draft architecture or config the verifier's own forward does not implement."""


class ModelNotFound(SpecError):
    """An OpenAI-compatible request named a model this deployment does not serve."""

    status, code = 404, "model_not_found"


class VersionUnavailable(SpecError):
    """A declared target version whose adapter cannot be served: its opens and sessions answer 503 with the reason."""

    status, code = 503, "model_unavailable"
