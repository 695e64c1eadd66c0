"""Session affinity and version preference (deploy/router/affinity.py), on stand-in replicas:
a session's calls go to its replica; an open goes to the least loaded; an open of a target
version prefers the replicas holding it, but only within the load margin of the least loaded."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from deploy.router.affinity import (DEFAULT_VERSION_MARGIN, SessionAffinityRouter, _version_of, replica_of,
                                    version_ranks)


def replica(tag: str, sessions: int = 0, pending: int = 0, kv: int = 0, adapters=()):
    """What the router reads of a RunningReplica: its id and ``record_routing_stats``."""
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=tag),
                           routing_stats={"sessions": sessions, "pending": pending, "kv_tokens": kv,
                                          "adapters": list(adapters)})


def request(**kwargs):
    """What the router reads and writes of a PendingRequest: the call's kwargs, its routing context."""
    return SimpleNamespace(kwargs=kwargs, routing_context=SimpleNamespace(should_backoff=False))


def router(**kwargs) -> SessionAffinityRouter:
    r = object.__new__(SessionAffinityRouter)  # no Serve plumbing: choose_replicas reads only these
    r.initialize_state(**kwargs)
    return r


def choose(rt, replicas, req) -> list[list[str]]:
    ranks = asyncio.run(rt.choose_replicas(replicas, req))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_version_of_reads_the_open_body_model():
    assert _version_of(request(body={"model": "code", "prompt_ids": [1]})) == "code"
    assert _version_of(request(body={"prompt_ids": [1]})) is None
    assert _version_of(request(body={"model": None})) is None
    assert _version_of(request(body={"model": 5})) is None  # not a name: no preference
    assert _version_of(request(body="not a dict")) is None
    assert _version_of(request(session_id="a.b")) is None
    assert _version_of(None) is None


def test_a_sessions_calls_go_to_its_replica_and_opens_to_the_least_loaded():
    reps = [replica("r1", sessions=5), replica("r2", sessions=1), replica("r3", sessions=3, pending=4)]
    rt = router()
    assert replica_of("r3.abc") == "r3" and replica_of("nodot") is None
    assert choose(rt, reps, request(session_id="r3.abc")) == [["r3"]]
    assert choose(rt, reps, request(session_id="gone.abc")) == [["r2", "r1"]]  # any: it answers 404
    assert choose(rt, reps, request(body={"prompt_ids": [1]})) == [["r2"], ["r1"]]  # pending counts as load
    assert choose(rt, [], request()) == []


def test_an_open_of_a_version_prefers_its_holders_then_the_others():
    reps = [replica("r1", sessions=2), replica("r2", sessions=3, adapters=["code"]),
            replica("r3", sessions=4, adapters=["code", "docs"]), replica("r4", sessions=0)]
    assert choose(router(), reps, request(body={"model": "code"})) == [["r2"], ["r3"], ["r4", "r1"]]
    assert choose(router(), reps, request(body={"model": "docs"})) == [["r3"], ["r4", "r1"]]
    # nobody holds it, or everybody does: by load alone
    assert choose(router(), reps, request(body={"model": "chat"})) == [["r4"], ["r1"]]
    every = [replica(f"r{i}", sessions=i, adapters=["code"]) for i in range(3)]
    assert choose(router(), every, request(body={"model": "code"})) == [["r0"], ["r1"]]


@pytest.mark.parametrize("margin", [0, 2, DEFAULT_VERSION_MARGIN, 10])
def test_holders_are_preferred_only_within_the_load_margin(margin):
    """A holder more than ``margin`` sessions above the least loaded is not preferred: the open
    goes to the least loaded (which then loads the version), so a version's sessions spread."""
    least = replica("idle", sessions=1)
    for load in range(1, 14):
        holder = replica("holder", sessions=load, adapters=["code"])
        ranks = version_ranks(sorted([least, holder], key=lambda r: r.routing_stats["sessions"]), "code", margin)
        first = ranks[0][0].replica_id.unique_id
        assert first == ("holder" if load <= 1 + margin else "idle"), (load, margin)
        assert (len(ranks) == 2) == (load <= 1 + margin)


def test_sessions_of_one_version_spread_over_replicas():
    """Opens of one version, each landing where the router sends it first (and loading the version
    there): with the margin the replicas' loads stay within it; without it one replica takes all."""
    def run(margin: int) -> list[int]:
        reps = [replica(f"r{i}") for i in range(4)]
        rt = router(version_margin=margin)
        for _ in range(40):
            first = asyncio.run(rt.choose_replicas(reps, request(body={"model": "code"})))[0][0]
            first.routing_stats["sessions"] += 1
            first.routing_stats["adapters"] = ["code"]
        return sorted(r.routing_stats["sessions"] for r in reps)

    spread = run(2)
    assert sum(spread) == 40 and spread[-1] - spread[0] <= 3
    assert run(1 << 30) == [0, 0, 0, 40]  # holders always first: the pile-up the margin prevents


class _Still:
    """A clock that moves only when told (specdec.clock)."""

    def __init__(self):
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t

    def blocking_sleep(self, seconds: float) -> None:
        self.t += seconds


def test_a_burst_of_opens_inside_one_stats_period_spreads_and_the_count_heals():
    """Serve pushes routing stats once a second: every open of a burst reads the same loads. The router
    counts what it sent each replica until its stats move (or UNSEEN_OPENS_S passes), so a burst of 8
    over 2 replicas (one showing 2 sessions) evens them out; the counts then drop on their own."""
    from specdec import clock
    from deploy.router.affinity import UNSEEN_OPENS_S

    with clock.use(_Still()) as c:
        busy, idle = reps = [replica("busy", sessions=2), replica("idle")]
        rt = router()
        firsts = [choose(rt, reps, request(body={"prompt_ids": [i]}))[0][0] for i in range(8)]
        assert (firsts.count("busy"), firsts.count("idle")) == (3, 5)  # 2 + 3 = 0 + 5
        assert choose(rt, reps, request(session_id="busy.x")) == [["busy"]]  # a session's call: not counted
        assert sorted(choose(rt, reps, request(session_id="gone.x"))[0]) == ["busy", "idle"]  # nor a lost one's
        assert (rt._unseen_opens(busy), rt._unseen_opens(idle)) == (3, 5)
        idle.routing_stats["sessions"] = 5  # idle's stats now show its opens
        assert (rt._unseen_opens(busy), rt._unseen_opens(idle)) == (3, 0)
        c.blocking_sleep(UNSEEN_OPENS_S + 0.1)  # busy's never moved (its opens were closed at once)
        assert rt._unseen_opens(busy) == 0


def test_the_margin_comes_from_the_deployments_router_kwargs():
    from deploy.application import verifier_options
    from deploy.config import AppConfig

    cfg = AppConfig(verifier={"version_affinity_margin": 7})
    rc = verifier_options(cfg)["request_router_config"]
    assert rc.request_router_kwargs == {"version_margin": 7, "prefix_margin": 4}
    assert router(**rc.request_router_kwargs).version_margin == 7
    assert router().version_margin == DEFAULT_VERSION_MARGIN == AppConfig().verifier.version_affinity_margin


def opened(rt, replicas, body, tenant="t"):
    """An open routed as Serve would: the first replica of the first rank, then ``on_request_routed``."""
    req = request(tenant=tenant, body=body)
    chosen = asyncio.run(rt.choose_replicas(replicas, req))[0][0]
    rt.on_request_routed(req, chosen.replica_id, None)
    chosen.routing_stats["sessions"] += 1
    return chosen.replica_id.unique_id


def test_an_open_that_begins_like_an_earlier_one_goes_to_its_replica_within_the_margin():
    from deploy.router.affinity import PAGE, prefix_keys
    from specdec.model.native import PAGE_SIZE

    assert PAGE == PAGE_SIZE
    reps = [replica(f"r{i}") for i in range(4)]
    rt = router(prefix_margin=2)
    turn1 = list(range(3, 3 + 3 * PAGE))
    first = opened(rt, reps, {"prompt_ids": turn1})
    turn2 = turn1 + [7] * (2 * PAGE)  # the next turn of that conversation
    assert opened(rt, reps, {"prompt_ids": turn2}) == first  # r0 holds 1 session, the others 0: within 2
    assert opened(rt, reps, {"prompt_ids": turn2}, tenant="other") != first  # another tenant's cache is apart
    assert opened(rt, reps, {"prompt_ids": turn2, "model": "code"}) != first  # and another version's
    assert opened(rt, reps, {"prompt_ids": turn2 + [8]}) == first  # now 3 sessions there
    assert opened(rt, reps, {"prompt_ids": turn2 + [9]}) != first  # 3 > the least loaded's 1 + 2
    assert opened(rt, reps, {"prompt_ids": [5] * PAGE}) is not None  # no whole page with a token after it
    assert prefix_keys(request(tenant="t", body={"prompt_ids": [5] * PAGE})) == []
    assert prefix_keys(request(session_id="r0.x", body={"prompt_ids": turn2})) == []  # not an open
    assert len(prefix_keys(request(tenant="t", body={"prompt_ids": turn2}))) == 3  # 1, 2 and 4 pages


def test_a_shared_system_prompt_does_not_pile_every_chat_onto_one_replica():
    from deploy.router.affinity import PAGE

    reps = [replica(f"r{i}") for i in range(4)]
    rt = router(prefix_margin=2)
    system = list(range(10, 10 + 2 * PAGE))
    for i in range(40):
        opened(rt, reps, {"prompt_ids": system + [100 + i] * PAGE})
    spread = sorted(r.routing_stats["sessions"] for r in reps)
    assert sum(spread) == 40 and spread[-1] - spread[0] <= 3


class _Busy:
    """A stand-in RunningReplica whose queue reads full until ``free`` is set (a replica at its
    ``max_ongoing_requests``, or one whose probe times out as a dying node's does)."""

    def __init__(self, tag: str, free: bool):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(tag, DeploymentID("Verifier", "app"))
        self.max_ongoing_requests, self.routing_stats, self.free, self.probes = 4, {"sessions": 1}, free, 0
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "n", None, set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        return 0 if self.free else self.max_ongoing_requests


def test_a_session_waiting_for_its_busy_replica_is_never_handed_another_replica():
    """Serve's routing tasks hand a replica to a pending request; the affinity router must give each call the
    replica its own choice named. A FIFO hand-off (Serve's default mixin) gives the oldest pending call, a
    session of the busy replica, the free replica another call found: it answers 404 and orphans the session.
    While its replica is full, the waiting call's retries back off (Serve re-asks at once unless told to)."""
    import time
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    backoff_s = 0.01

    async def run() -> dict[str, str]:
        busy, free = _Busy("busy", free=False), _Busy("free", free=True)
        rt = SessionAffinityRouter(DeploymentID("Verifier", "app"), DeploymentHandleSource.UNKNOWN,
                                   initial_backoff_s=backoff_s, max_backoff_s=2 * backoff_s)
        rt.initialize_state()
        rt.update_replicas([busy, free])

        def pending(sid: str) -> PendingRequest:
            return PendingRequest(args=[], kwargs={"session_id": sid},
                                  metadata=RequestMetadata(request_id=sid, internal_request_id=sid))

        t0 = time.monotonic()
        waiting = asyncio.ensure_future(rt._choose_replica_for_request(pending("busy.s1")))
        await asyncio.sleep(0.1)  # its routing task backs off: its replica's queue is full
        got = {"free.s2": (await rt._choose_replica_for_request(pending("free.s2"))).replica_id.unique_id}
        assert busy.probes <= (time.monotonic() - t0) / backoff_s + 3, busy.probes  # not a tight loop
        busy.free = True
        got["busy.s1"] = (await asyncio.wait_for(waiting, 10)).replica_id.unique_id
        return got

    assert asyncio.run(run()) == {"free.s2": "free", "busy.s1": "busy"}
