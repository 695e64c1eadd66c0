"""The replica's records of its sessions: who owns each, what its edge reported, which are gone.

A gone session's requests answer why (410, 404, 503); docs/verifier.md, "Sessions". Pure module."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from deploy.verifier.eviction import SessionUse
from specdec.errors import ModelNotFound, SessionEvicted, SessionNotFound, VersionUnavailable
from specdec.model.native import PAGE_SIZE

MAX_REMEMBERED_EVICTIONS = 100_000


@dataclass
class EdgeClient:
    """What a session's edge tells the replica: its draft time and RTT (SpecEdge §4.3 depth
    pacing) and, in ``ahead``, the tokens a no-tree request brings back (run-ahead's limit and bonus; else 1)."""

    draft_ms: float = 0.0
    rtt_ms: float = 0.0
    ahead: int = 1
    run_from_open: bool = False  # the open asked for run-ahead from its first token (ClientInfo.run_ahead)
    draft: str | None = None  # its draft class (ClientInfo.draft): whose acceptance estimates pace it
    close_on_finish: bool = False  # the open asked the replica to close it with its finishing reply
    logprobs: bool = False  # its replies carry the target's log-probs: no run-ahead (R_LOGPROBS)

    @classmethod
    def of_open(cls, body: dict, ahead: int, logprobs: bool) -> "EdgeClient":
        """What an open's body says; run-ahead replies of ``ahead`` tokens assumed until a request says otherwise."""
        c = body.get("client") or {}
        return cls(float(c.get("draft_ms") or 0.0), float(c.get("rtt_ms") or 0.0), ahead,
                   bool(c.get("run_ahead")) and not logprobs, draft_class(c.get("draft")),
                   bool(body.get("close_on_finish")), logprobs)


def draft_class(name) -> str | None:
    """An open's ``client.draft`` as a key: a string of at most 128 characters, else none."""
    return name if isinstance(name, str) and 0 < len(name) <= 128 else None


def _remember(book: OrderedDict, sid: str, value) -> None:
    """Record a gone session; past ``MAX_REMEMBERED_EVICTIONS`` the oldest record is forgotten."""
    book[sid] = value
    while len(book) > MAX_REMEMBERED_EVICTIONS:
        book.popitem(last=False)


class SessionBook:
    """Live sessions' owners and edges; gone sessions and why."""

    def __init__(self):
        self.owner: dict[str, str] = {}  # session id -> tenant
        self.client: dict[str, EdgeClient] = {}  # session id -> what its edge reported
        self.evicted: OrderedDict[str, str] = OrderedDict()  # session id -> reason
        self.closed_finished: OrderedDict[str, None] = OrderedDict()  # closed with their last reply

    def check(self, sid: str, tenant: str) -> None:
        """Raise the error a request of ``tenant`` for ``sid`` answers unless the session is its, live."""
        owner = self.owner.get(sid)
        if owner is None:
            reason = self.evicted.get(sid, "")
            if reason.startswith("model_removed"):
                raise ModelNotFound(f"session {sid!r}: its target version was removed from this server "
                                    f"({reason}); open a session of a served version")
            if reason.startswith("model_unavailable"):
                raise VersionUnavailable(f"session {sid!r}: its target version could not be loaded ({reason})")
            if sid in self.closed_finished:
                raise SessionEvicted(f"session {sid!r} finished and was closed with its last reply "
                                     f"(close_on_finish); open a new session")
            if sid in self.evicted:
                raise SessionEvicted(f"session {sid!r} was evicted ({reason}); re-open it with its history")
            raise SessionNotFound(f"unknown session {sid!r} (it may have been lost in a restart); re-open it")
        if owner != tenant:  # do not reveal that another tenant's session exists
            raise SessionNotFound(f"unknown session {sid!r}")

    def edge(self, sid: str) -> EdgeClient:
        """What the session's edge reported (defaults before it did)."""
        return self.client.get(sid) or EdgeClient()

    def closes_on_finish(self, sid: str) -> bool:
        edge = self.client.get(sid)
        return edge is not None and edge.close_on_finish

    def drop(self, sid: str) -> None:
        """Forget a live session's owner and edge."""
        self.owner.pop(sid, None)
        self.client.pop(sid, None)

    def evict(self, sid: str, reason: str) -> None:
        """Remember a session the engine no longer holds: its requests answer ``reason`` from now on."""
        self.drop(sid)
        _remember(self.evicted, sid, reason)

    def close_finished(self, sid: str) -> None:
        """Remember a session closed with its finishing reply (``close_on_finish``)."""
        self.drop(sid)
        _remember(self.closed_finished, sid, None)

    def pardon(self, sid: str) -> None:
        """A gone session's close request: forget why it went (the close answers 200)."""
        self.evicted.pop(sid, None)
        self.closed_finished.pop(sid, None)

    @staticmethod
    def kv_held(engine_sessions: dict) -> int:
        """KV tokens the live sessions hold in all (their committed tokens in whole pages), as :meth:`uses` counts them."""
        return sum(-(-len(s.prefix) // PAGE_SIZE) for s in engine_sessions.values()) * PAGE_SIZE

    def uses(self, engine_sessions: dict) -> list[SessionUse]:
        """Each live session's KV (its committed tokens in whole pages), tenant and last use."""
        return [SessionUse(sid, self.owner.get(sid, ""), -(-len(s.prefix) // PAGE_SIZE) * PAGE_SIZE, s.last_used)
                for sid, s in engine_sessions.items()]
