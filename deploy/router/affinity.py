"""Session affinity: every request of a session reaches the replica holding its KV.

:class:`SessionAffinityRouter` (a Ray Serve request router): a session's calls go to the replica that minted its id,
an open to the least loaded or, within a margin, to a holder of its version or prefix (docs/router.md)."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specdec import clock

DEFAULT_VERSION_MARGIN = 4  # verifier.version_affinity_margin's default
DEFAULT_PREFIX_MARGIN = 4  # verifier.prefix_affinity_margin's default
PAGE = 16  # the verifier's KV page (specdec.model.native.PAGE_SIZE): the prefix cache shares whole pages
PREFIX_PAGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # prefix lengths remembered, in pages
MAX_PREFIXES = 1 << 16
UNSEEN_OPENS_S = 3.0  # opens sent count in a replica's load until its routing stats move, at most this long


@dataclass
class UnseenOpens:
    """Opens this router sent a replica that its routing stats (``stats``, pushed every second) may not show yet."""

    stats: tuple  # the replica's (sessions, pending, kv_tokens) when the first of them was sent
    count: int
    since: float  # clock.monotonic() of the first


def replica_of(session_id: str) -> str | None:
    tag, sep, _ = session_id.partition(".")
    return tag if sep else None


class SessionAffinityRouter(RequestRouter):
    # Not Serve's FIFOMixin: it hands a replica one call chose to the oldest pending call, a session of another
    # replica (busy, or on a dying node), which then answers 404 and orphans the session; the base router gives
    # each call the replica its own choice named.

    version_margin = DEFAULT_VERSION_MARGIN
    prefix_margin = DEFAULT_PREFIX_MARGIN

    def initialize_state(self, version_margin: int = DEFAULT_VERSION_MARGIN,
                         prefix_margin: int = DEFAULT_PREFIX_MARGIN, **kwargs):
        """The deployment's ``request_router_kwargs`` (deploy/application.py)."""
        self.version_margin, self.prefix_margin = version_margin, prefix_margin
        self._prefixes: OrderedDict[int, str] = OrderedDict()  # prefix key -> the replica its last open went to
        self._unseen: dict[str, UnseenOpens] = {}  # replica tag -> opens its stats do not show yet

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:  # Serve re-asks at once without it: a tight loop while a replica is full
            pending_request.routing_context.should_backoff = True
        sid = pending_request.kwargs.get("session_id") if pending_request is not None else None
        if sid:
            tag = replica_of(str(sid))
            for r in candidate_replicas:
                if r.replica_id.unique_id == tag:
                    return [[r]]
        load = {r.replica_id.unique_id: _sessions(r) + self._unseen_opens(r) for r in candidate_replicas}
        ranked = sorted(candidate_replicas, key=lambda r: _rank_key(r, load))
        holder = self._prefix_holder(ranked, prefix_keys(pending_request), load)
        if holder is not None:
            ranks = [[holder], [r for r in ranked if r is not holder][:2]]
        else:
            version = _version_of(pending_request)
            ranks = version_ranks(ranked, version, self.version_margin, load) if version else [ranked[:2]]
        if sid:  # a session whose replica is gone: any, it answers 404
            return ranks
        first = ranks[0][0]  # an open goes where this router's own count says, not where a stale tie falls
        self._count_open(first)
        return [rank for rank in ([first], ranks[0][1:], *ranks[1:]) if rank]

    def _unseen_opens(self, r: RunningReplica) -> int:
        """Opens sent ``r`` while its routing stats stood still (up to :data:`UNSEEN_OPENS_S`): a burst of
        opens inside one stats period would otherwise all see the same loads and land on one replica."""
        tag = r.replica_id.unique_id
        u = self._unseen.get(tag)
        if u is not None and (u.stats != _stats_key(r) or clock.monotonic() - u.since > UNSEEN_OPENS_S):
            del self._unseen[tag]
            return 0
        return u.count if u is not None else 0

    def _count_open(self, r: RunningReplica) -> None:
        tag = r.replica_id.unique_id
        u = self._unseen.setdefault(tag, UnseenOpens(_stats_key(r), 0, clock.monotonic()))
        u.count += 1

    def _prefix_holder(self, ranked: list[RunningReplica], keys: list[int],
                       load: dict[str, int]) -> RunningReplica | None:
        """The replica the longest remembered prefix of ``keys`` went to, if within the margin."""
        by_tag = {r.replica_id.unique_id: r for r in ranked}
        least = load[ranked[0].replica_id.unique_id]
        for key in keys:
            tag = self._prefixes.get(key)
            if tag in by_tag:
                return by_tag[tag] if load[tag] <= least + self.prefix_margin else None
        return None

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """An open went to ``replica_id``: its prompt's prefixes are remembered there."""
        for key in prefix_keys(pending_request):
            self._prefixes[key] = replica_id.unique_id
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > MAX_PREFIXES:
            self._prefixes.popitem(last=False)


def prefix_keys(pending_request: PendingRequest | None) -> list[int]:
    """Keys of an open's prompt + history prefixes of :data:`PREFIX_PAGES` whole pages (each
    with a token after it), with its tenant and version; longest first; empty for any other call."""
    kwargs = pending_request.kwargs if pending_request is not None else {}
    body = kwargs.get("body")
    if kwargs.get("session_id") or not isinstance(body, dict) or not isinstance(body.get("prompt_ids"), list):
        return []
    tokens = list(body["prompt_ids"]) + list(body.get("generated") or ())
    scope = (kwargs.get("tenant"), body.get("model"))
    return [hash((scope, tuple(tokens[: n * PAGE]))) for n in reversed(PREFIX_PAGES) if n * PAGE < len(tokens)]


def _sessions(r: RunningReplica) -> int:
    """A replica's load: its sessions and the requests waiting for its engine."""
    st = r.routing_stats or {}
    return st.get("sessions", 0) + st.get("pending", 0)


def _stats_key(r: RunningReplica) -> tuple:
    st = r.routing_stats or {}
    return st.get("sessions", 0), st.get("pending", 0), st.get("kv_tokens", 0)


def _rank_key(r: RunningReplica, load: dict[str, int]) -> tuple:
    """Sort key: load, then KV tokens, ties at random."""
    return (load[r.replica_id.unique_id], (r.routing_stats or {}).get("kv_tokens", 0), random.random())


def version_ranks(ranked: list[RunningReplica], version: str, margin: int,
                  load: dict[str, int] | None = None) -> list[list[RunningReplica]]:
    """Replicas ``ranked`` by ``load`` (default: their stats) -> the ranks to try for an open of ``version``: holders
    within ``margin`` sessions of the least loaded, then the least loaded others; else (none close, or all hold it)
    by load."""
    load = load or {r.replica_id.unique_id: _sessions(r) for r in ranked}
    least = load[ranked[0].replica_id.unique_id]
    holders = [r for r in ranked if version in ((r.routing_stats or {}).get("adapters") or ())
               and load[r.replica_id.unique_id] <= least + margin]
    if holders and len(holders) < len(ranked):
        return [holders[:2], [r for r in ranked if r not in holders][:2]]
    return [ranked[:2]]


def _version_of(pending_request: PendingRequest | None) -> str | None:
    """The target version an open asks for (``body.model``), if any."""
    body = pending_request.kwargs.get("body") if pending_request is not None else None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
