"""Session affinity: every request of a session reaches the replica holding its KV.

A Ray Serve custom request router (``RequestRouter``). Session ids are
``<replica unique id>.<random>``, minted by the verifier replica that prefilled them;
a call that carries ``session_id=...`` goes to that replica. If the replica is gone
(restart, scale-down) the call goes to any replica, which answers
``404 session_not_found`` and the edge re-opens from its token history. Calls without
a session id (opening a session) go to the replica with the fewest sessions / KV
tokens (from ``record_routing_stats``), ties broken at random; an open of a target
version (a LoRA adapter, ``model``) prefers the replicas that hold it loaded, as Ray
Serve's model multiplexing does, and falls back to the others when those are full.
"""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def replica_of(session_id: str) -> str | None:
    tag, sep, _ = session_id.partition(".")
    return tag if sep else None


class SessionAffinityRouter(FIFOMixin, RequestRouter):
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

        def load(r: RunningReplica) -> tuple:
            st = r.routing_stats or {}
            return (st.get("sessions", 0) + st.get("pending", 0), st.get("kv_tokens", 0), random.random())

        ranked = sorted(candidate_replicas, key=load)
        version = _version_of(pending_request)
        if version:
            holders = [r for r in ranked if version in ((r.routing_stats or {}).get("adapters") or ())]
            if holders and len(holders) < len(ranked):
                return [holders[:2], [r for r in ranked if r not in holders][:2]]
        return [ranked[:2]]


def _version_of(pending_request: PendingRequest | None) -> str | None:
    """The target version an open asks for (``body.model``), if any."""
    body = pending_request.kwargs.get("body") if pending_request is not None else None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
