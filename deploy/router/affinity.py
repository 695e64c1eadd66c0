"""Session affinity: every request of a session reaches the replica holding its KV.

A Ray Serve custom request router (``RequestRouter``). Session ids are
``<replica unique id>.<random>``, minted by the verifier replica that prefilled them;
a call that carries ``session_id=...`` goes to that replica. If the replica is gone
(restart, scale-down) the call goes to any replica, which answers
``404 session_not_found`` and the edge re-opens from its token history. Calls without
a session id (opening a session) go to the replica with the fewest sessions / KV
tokens (from ``record_routing_stats``), ties broken at random.

An open of a target version (a LoRA adapter, ``model``) prefers the replicas that hold
it loaded, as Ray Serve's model multiplexing does, but only those whose load is within
``version_margin`` sessions (``verifier.version_affinity_margin``) of the least-loaded
replica's: with ``max_ongoing_requests`` in the thousands a holder is never "full", and
every session of a popular version would pile onto the replica that loaded it first.
Past the margin the open goes to the least loaded, which loads the version (milliseconds
for a LoRA) and becomes a holder too.
"""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

DEFAULT_VERSION_MARGIN = 4  # verifier.version_affinity_margin's default


def replica_of(session_id: str) -> str | None:
    tag, sep, _ = session_id.partition(".")
    return tag if sep else None


class SessionAffinityRouter(FIFOMixin, RequestRouter):
    version_margin = DEFAULT_VERSION_MARGIN

    def initialize_state(self, version_margin: int = DEFAULT_VERSION_MARGIN, **kwargs):
        """The deployment's ``request_router_kwargs`` (deploy/application.py)."""
        self.version_margin = version_margin

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        sid = pending_request.kwargs.get("session_id") if pending_request is not None else None
        if sid:
            tag = replica_of(str(sid))
            for r in candidate_replicas:
                if r.replica_id.unique_id == tag:
                    return [[r]]
        ranked = sorted(candidate_replicas, key=_load)
        version = _version_of(pending_request)
        if version:
            return version_ranks(ranked, version, self.version_margin)
        return [ranked[:2]]


def _sessions(r: RunningReplica) -> int:
    """A replica's load: its sessions and the requests waiting for its engine."""
    st = r.routing_stats or {}
    return st.get("sessions", 0) + st.get("pending", 0)


def _load(r: RunningReplica) -> tuple:
    """Sort key: load, then KV tokens, ties at random."""
    return (_sessions(r), (r.routing_stats or {}).get("kv_tokens", 0), random.random())


def version_ranks(ranked: list[RunningReplica], version: str, margin: int) -> list[list[RunningReplica]]:
    """Replicas ``ranked`` by load -> the ranks to try for an open of ``version``: first the
    holders (replicas with it loaded) within ``margin`` sessions of the least loaded, then the
    least loaded others; with no holder close enough (or all holding it), by load alone."""
    least = _sessions(ranked[0])
    holders = [r for r in ranked if version in ((r.routing_stats or {}).get("adapters") or ())
               and _sessions(r) <= least + margin]
    if holders and len(holders) < len(ranked):
        return [holders[:2], [r for r in ranked if r not in holders][:2]]
    return [ranked[:2]]


def _version_of(pending_request: PendingRequest | None) -> str | None:
    """The target version an open asks for (``body.model``), if any."""
    body = pending_request.kwargs.get("body") if pending_request is not None else None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
