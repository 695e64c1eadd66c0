"""Tenants: API-key authentication, per-tenant session quota and token-rate limit.

Keys are stored hashed (SHA-256); limits hold per router replica (with R replicas, configure limits / R)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from deploy.config import TenantConfig, hash_api_key
from specdec import clock
from specdec.errors import Overloaded, Unauthorized


@dataclass
class TokenBucket:
    """Token-rate limit: ``rate`` tokens/s refill, ``capacity`` burst; may go negative."""

    rate: float
    capacity: float
    level: float = 0.0
    stamp: float = field(default_factory=clock.monotonic)

    def __post_init__(self):
        self.level = self.capacity

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def spend(self, tokens: float, now: float | None = None) -> None:
        self._refill(clock.monotonic() if now is None else now)
        self.level -= tokens

    def wait_time(self, now: float | None = None) -> float:
        """Seconds until the bucket is positive again (0 if it is)."""
        self._refill(clock.monotonic() if now is None else now)
        return 0.0 if self.level > 0 else (-self.level + 1e-9) / self.rate


@dataclass
class TenantState:
    config: TenantConfig
    sessions: dict[str, float] = field(default_factory=dict)  # session id -> last use (monotonic), oldest first
    opening: int = 0  # opens admitted and not yet answered: they hold a quota slot too
    closing_on_finish: set[str] = field(default_factory=set)  # sessions the replica closes as they finish
    bucket: TokenBucket | None = None
    tokens_served: int = 0

    def __post_init__(self):
        rate = self.config.tokens_per_second
        if rate > 0:
            self.bucket = TokenBucket(rate, self.config.burst_tokens or 10 * rate)


class TenantRegistry:
    def __init__(self, tenants: list[TenantConfig], retry_after_s: float = 1.0, idle_timeout_s: float = 600.0):
        self._by_hash = {t.api_key_sha256: TenantState(t) for t in tenants}
        self.by_name = {s.config.name: s for s in self._by_hash.values()}
        self.retry_after_s = retry_after_s
        self.idle_timeout_s = idle_timeout_s

    def authenticate(self, authorization: str | None) -> TenantState:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        digest = hash_api_key(authorization[7:].strip())
        for h, state in self._by_hash.items():
            if hmac.compare_digest(h, digest):
                return state
        raise Unauthorized("unknown API key")

    def _expire(self, t: TenantState, now: float) -> None:
        # the verifier times idle sessions out; forget them here too so quotas do not leak.
        # t.sessions is in order of last use (session_used moves a session to the end), so the
        # stale ones are a prefix: the walk stops at the first fresh one
        stale = []
        for sid, seen in t.sessions.items():
            if now - seen <= self.idle_timeout_s:
                break
            stale.append(sid)
        for sid in stale:
            self.session_gone(t, sid)

    def admit_session(self, t: TenantState) -> None:
        """Take a session slot for an open, checked and taken at once; :meth:`open_done` gives it back."""
        now = clock.monotonic()
        self._expire(t, now)
        if len(t.sessions) + t.opening >= t.config.max_sessions:
            raise Overloaded(f"tenant {t.config.name!r} has {len(t.sessions) + t.opening} open sessions, its "
                             f"limit is {t.config.max_sessions}; close one first", retry_after=self.retry_after_s,
                             reason="tenant_sessions")
        self.check_rate(t)
        t.opening += 1

    def open_done(self, t: TenantState) -> None:
        t.opening -= 1

    def check_rate(self, t: TenantState) -> None:
        if t.bucket is not None:
            wait = t.bucket.wait_time()
            if wait > 0:
                raise Overloaded(f"tenant {t.config.name!r} is over its token rate of "
                                 f"{t.config.tokens_per_second:g} tokens/s", retry_after=max(wait, 0.05),
                                 reason="tenant_rate")

    def session_opened(self, t: TenantState, sid: str, close_on_finish: bool = False) -> None:
        """``close_on_finish``: the replica closes the session with its finishing reply."""
        t.sessions[sid] = clock.monotonic()
        if close_on_finish:
            t.closing_on_finish.add(sid)

    def session_finished(self, t: TenantState, sid: str) -> None:
        """A reply said the session finished: one the replica closed with it holds no slot."""
        if sid in t.closing_on_finish:
            self.session_gone(t, sid)

    def session_used(self, t: TenantState, sid: str, tokens: int) -> None:
        if t.sessions.pop(sid, None) is not None:
            t.sessions[sid] = clock.monotonic()  # to the end: the dict stays in order of last use
        t.tokens_served += tokens
        if t.bucket is not None and tokens:
            t.bucket.spend(tokens)

    def session_gone(self, t: TenantState, sid: str) -> None:
        t.sessions.pop(sid, None)
        t.closing_on_finish.discard(sid)
