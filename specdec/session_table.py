"""The engine's live sessions, shared with its collaborators: lookups, the checks a round
makes, what a session may still emit, and emitting tokens (:mod:`specdec.engine`)."""

from __future__ import annotations

from specdec.engine_types import Session
from specdec.errors import ModelNotFound, PrefixMismatch, SessionFinished, SessionNotFound


class SessionTable:
    """Live sessions by id on one runner's KV pool. Invariant: a live session's KV holds
    ``prefix[:-1]``; a finished session's KV is dropped (offered to the prefix cache first)."""

    def __init__(self, runner, *, max_model_len: int, prefix_caching: bool, adapters=None):
        self.sessions: dict[str, Session] = {}
        self.runner = runner
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.adapters = adapters  # AdapterRegistry: LoRA target versions (None: the base only)
        self.version_epoch: dict[str, int] = {}  # a re-pointed version's cached KV is never matched again

    def get(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise SessionNotFound(f"unknown session {sid!r}")
        return s

    def live(self, sid: str, prefix_len: int) -> Session:
        """The session a round at ``prefix_len`` extends: not finished, its version served, the prefix its own."""
        s = self.get(sid)
        if s.finished:
            raise SessionFinished(f"session {sid!r} is finished ({s.finish_reason})")
        self.check_version(s.adapter)
        if prefix_len != len(s.prefix):
            raise PrefixMismatch(f"request assumes a prefix of {prefix_len} tokens, the session has "
                                 f"{len(s.prefix)}", server_prefix_len=len(s.prefix))
        return s

    def check_version(self, name: str | None) -> None:
        """404 ``model_not_found`` unless ``name`` is the base (None) or a served version."""
        if name is not None:
            if self.adapters is None:
                raise ModelNotFound(f"target version {name!r} is not served here (no versions configured)")
            self.adapters.check(name)

    def remaining(self, s: Session) -> int:
        """Tokens the session may still emit (``max_tokens`` and the context)."""
        return min(s.params.max_tokens - s.num_generated, self.max_model_len - 1 - len(s.prefix))

    def emit(self, s: Session, tokens: list[int]) -> None:
        """Append emitted tokens and update the finished state (and the session's grammar)."""
        if s.grammar is not None:
            s.grammar.accept(tokens)
        s.prefix.extend(tokens)
        if tokens and tokens[-1] in s.stop_ids:
            s.finished, s.finish_reason = True, "stop"
        elif s.num_generated >= s.params.max_tokens or len(s.prefix) >= self.max_model_len - 1:
            s.finished, s.finish_reason = True, "length"
        if s.finished:  # its KV is never needed again by it, maybe by later prompts
            if self.prefix_caching:
                self.cache(s)
            self.runner.drop(s.sid)

    def salt(self, s: Session) -> tuple:
        """Sessions share cached KV only with the same salt, target version and version epoch."""
        return s.cache_salt, s.adapter, self.version_epoch.get(s.adapter, 0)

    def cache(self, s: Session) -> None:
        """Offer a session's committed KV (``prefix[:kv_length]``) to later prompts."""
        self.runner.cache_prefix(s.sid, s.prefix[: self.runner.kv_length(s.sid)], self.salt(s))
