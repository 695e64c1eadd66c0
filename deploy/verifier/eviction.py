"""Which sessions a replica evicts when KV memory or the session count runs out.

Own quota first (``kv_quota_tokens``), then tenants over their fair share (docs/verifier.md, "Eviction")."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class SessionUse:
    sid: str
    tenant: str
    kv_tokens: int  # KV capacity held (whole pages)
    last_used: float  # monotonic seconds


@dataclass(frozen=True)
class Limits:
    kv_budget_tokens: int
    max_sessions: int
    quotas: dict[str, int]  # tenant -> KV tokens (tenants without a quota are absent)
    weights: dict[str, float]  # tenant -> fair-share weight (default 1)


def within_limits(limits: Limits, sessions: int, kv_tokens: int) -> bool:
    """Whether every limit holds with no tenant quota to check (then :func:`choose_victims` evicts nobody)."""
    return not limits.quotas and sessions <= limits.max_sessions and kv_tokens <= limits.kv_budget_tokens


def choose_victims(sessions: list[SessionUse], limits: Limits, protect: frozenset[str] = frozenset()) -> list[str]:
    """Session ids to evict, in order, so that every limit holds (as far as unprotected sessions allow)."""
    live = {s.sid: s for s in sessions}
    usage: dict[str, int] = defaultdict(int)
    for s in sessions:
        usage[s.tenant] += s.kv_tokens
    victims: list[str] = []

    def evict(s: SessionUse) -> None:
        victims.append(s.sid)
        usage[s.tenant] -= s.kv_tokens
        del live[s.sid]

    lru = sorted((s for s in sessions if s.sid not in protect), key=lambda s: s.last_used)
    for s in lru:  # 1. tenants over their own quota
        quota = limits.quotas.get(s.tenant)
        if quota is not None and usage[s.tenant] > quota:
            evict(s)

    def over_limits() -> bool:
        return sum(usage.values()) > limits.kv_budget_tokens or len(live) > limits.max_sessions

    while over_limits():  # 2. the replica budget: tenants over their fair share first
        candidates = [s for s in lru if s.sid in live]
        if not candidates:
            break
        active = {s.tenant for s in live.values()}
        total_weight = sum(limits.weights.get(t, 1.0) for t in active)
        share = {t: limits.kv_budget_tokens * limits.weights.get(t, 1.0) / total_weight for t in active}
        evict(next((s for s in candidates if usage[s.tenant] > share[s.tenant]), candidates[0]))
    return victims
