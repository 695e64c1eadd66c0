"""sim/system.py: the simulated system is the production router and verifier code, one seed
gives one trace, and the served output stays the target's (tiny target, synthetic profile)."""

from __future__ import annotations

import dataclasses

import pytest

from deploy.config import AppConfig
from deploy.router.affinity import SessionAffinityRouter
from deploy.router.ingress import Router
from deploy.verifier.batch_loop import BatchLoop
from deploy.verifier.server import VerifierServer
from deploy.verifier.scheduler import FairScheduler
from sim.cost_profile import CostProfile
from sim.system import System
from sim.virtual_time import VirtualClock, run
from sim.workload import Workload
from tests.sim.test_cost_profile import _profile

APP = {"target": {"model": "tiny-random", "dtype": "float32"}, "verifier": {"num_replicas": 2, "max_batch_sessions": 8}}


def simulate(seed: int, users: int = 12, **workload) -> tuple[dict, System]:
    w = Workload(users=users, duration_s=8.0, warmup_s=1.0, max_tokens=24, spawn_rate=20.0,
                 network={"rtt_ms": 30.0, "rtt_sigma": 0.3}, **workload)
    vc = VirtualClock()
    s = System(AppConfig(**APP), CostProfile.fit(_profile(model="tiny-random", dtype="float32"), "synthetic"), w,
               seed, vc)
    return run(s.run(), vc), s


def test_the_simulated_router_and_verifiers_are_the_production_classes():
    out, s = simulate(0)
    raw_router = next(c for c in Router.func_or_class.__mro__[1:] if c.__name__ == "Router")
    assert type(s.router) is raw_router
    assert type(s.fleet.affinity) is SessionAffinityRouter
    assert len(s.fleet.replicas) == 2
    for core in s.fleet.replicas.values():
        assert type(core) is VerifierServer and type(core.loop) is BatchLoop and type(core.loop.sched) is FairScheduler
    # the simulation adds no scheduling of its own: none of its modules defines a batcher or a router
    import sim.system as system
    own = {n for n, v in vars(system).items() if isinstance(v, type) and v.__module__ == system.__name__}
    assert own == {"Trace", "Fleet", "System"}
    import sim.users as users
    own = {n for n, v in vars(users).items() if isinstance(v, type) and v.__module__ == users.__name__}
    assert own == {"Counters", "DraftDevices", "EdgeUser"}
    assert out["forwards"] > 0 and all(b > 0 for b in out["replica_busy_fraction"].values())


def test_a_simulated_forwards_cpu_is_what_its_worker_spent_and_the_window_counts_its_rounds():
    """The replicas' counters read the simulated CPU (clock.thread_time): on cores of their own a forward's
    CPU is its time; the summary's replica window is theirs over the steady window."""
    out, s = simulate(0)
    for core in s.fleet.replicas.values():
        d = core.counters.to_dict()
        assert d["busy_seconds"] > 0 and sum(d["busy_cpu_seconds"].values()) == pytest.approx(d["busy_seconds"])
    w = out["replica_window"]
    assert w["forward_cpu_ms"] > 0 and w["round_ms_mean"] > 0 and w["sessions_per_forward"] >= 1
    assert w["verify_forwards_per_s"] * (8.0 - 1.0) <= out["forwards"]  # the window's forwards, not all
    # over the window alone, as the load test samples a replica: not the generations that finish after it
    for tag, start in s.replicas_at_window.items():
        assert s.replicas_at_window_end[tag]["uptime_seconds"] - start["uptime_seconds"] == pytest.approx(8.0 - 1.0)
    at_summary = {t: c.counters.to_dict() for t, c in s.fleet.replicas.items()}
    assert out["simulated_s"] > 8.0 and s.replicas_at_window_end != at_summary


def test_one_seed_gives_one_trace():
    a, _ = simulate(3)
    b, _ = simulate(3)
    c, _ = simulate(4)
    assert a["trace_sha256"] == b["trace_sha256"] and a == b
    assert c["trace_sha256"] != a["trace_sha256"]


@pytest.mark.parametrize("mode", ["edge", "server_ar"])
def test_served_tokens_are_the_targets_and_no_idle_server_refuses_an_open(mode):
    out, _ = simulate(1, mode=mode)
    assert out["diverged_rounds"] == 0 and out["errors"] == 0 and out["opens_refused_while_idle"] == 0
    assert out["finished"] > 0 and out["verified_tokens_per_s"] > 0
    assert (out["tokens_per_round"] > 1.0) == (mode == "edge")  # drafts accepted only when there are drafts


def test_a_workload_tenant_the_deployment_lacks_is_refused():
    w = Workload(users=1, duration_s=2.0, warmup_s=0.5, tenants={"gold": 1.0})
    with pytest.raises(ValueError, match="gold"):
        System(AppConfig(**APP), CostProfile.fit(_profile(model="tiny-random", dtype="float32")), w, 0, VirtualClock())


def test_host_cpu_per_request_takes_its_time_in_the_router_and_the_replica(tmp_path):
    """HostCost: a request's CPU outside the forward is spent in the router's process and on its
    replica's event loop (beside its forward thread): each takes its seconds per call, so no round
    is shorter than both (a run-ahead reply needs no forward); a bad file names its fields."""
    from sim.cost_profile import HostCost, ProfileError

    vc = VirtualClock()
    w = Workload(users=12, duration_s=8.0, warmup_s=1.0, max_tokens=24, spawn_rate=20.0,
                 network={"rtt_ms": 30.0, "rtt_sigma": 0.3})
    profile = CostProfile.fit(_profile(model="tiny-random", dtype="float32"), "synthetic")
    s = System(AppConfig(**APP), profile, w, 1, vc, HostCost(router_s=0.004, replica_s=0.003, source="test"))
    slow = run(s.run(), vc)
    assert slow["host_cost"] == "test" and slow["diverged_rounds"] == 0
    assert min(s.counters.round_s) >= 0.004 + 0.003 - 1e-9
    loop_cpu = sum(w.busy_seconds for w in s.fleet.loop_cpu.values())
    assert loop_cpu == pytest.approx(0.003 * s.fleet.calls, rel=0.05)  # opens, verifies, closes (no other call)
    assert s.router_cpu.busy_seconds >= 0.004 * slow["verify_rounds_per_s"] * slow["window_s"]
    (tmp_path / "h.json").write_text('{"router_ms_per_request": 1}')
    with pytest.raises(ProfileError, match="replica_ms_per_request"):
        HostCost.load(tmp_path / "h.json")


def test_the_routers_cpu_after_admission_is_spent_in_flight():
    """HostCost.admit_share: of the router's CPU before the replica call, that share is spent before
    admission, the rest after it, inside the verify call the router times (as its asyncio loop admits a
    request as soon as it reads it); its total CPU per request is the same either way."""
    from sim.cost_profile import HostCost

    w = Workload(users=8, duration_s=6.0, warmup_s=1.0, max_tokens=24, spawn_rate=20.0,
                 network={"rtt_ms": 30.0, "rtt_sigma": 0.3})
    profile = CostProfile.fit(_profile(model="tiny-random", dtype="float32"), "synthetic")

    def router(admit_share):
        vc = VirtualClock()
        host = HostCost(router_s=0.004, replica_s=0.003, reply_share=0.5, admit_share=admit_share, source="test")
        s = System(AppConfig(**APP), profile, w, 1, vc, host)
        run(s.run(), vc)
        return min(s.counters.router_verify_s), s.router_cpu.busy_seconds / (s.fleet.calls + s.counters.shed)

    before, per_request = router(1.0)
    after, per_request_after = router(0.25)
    assert before >= 0.002 + 0.003 - 1e-9 and before < 0.004 + 0.003  # the reply's half only
    assert after >= 0.004 * (0.5 + 0.5 * 0.75) + 0.003 - 1e-9  # and the send after admission
    assert per_request == pytest.approx(0.004, rel=0.02) and per_request_after == pytest.approx(0.004, rel=0.02)


def test_the_background_processes_bursts_slow_the_rounds_they_overlap(tmp_path):
    """HostCost.burst_*: another process takes most of the shared cores for 1 s every 4 s; the rounds
    then in flight wait (the tail grows, the throughput falls), and one seed still gives one trace.
    The burst fields load from a host file, and a burst as long as its period is refused."""
    from sim.cost_profile import HostCost, ProfileError

    w = Workload(users=12, duration_s=12.0, warmup_s=1.0, max_tokens=24, spawn_rate=20.0,
                 network={"rtt_ms": 30.0, "rtt_sigma": 0.3})
    profile = CostProfile.fit(_profile(model="tiny-random", dtype="float32"), "synthetic")
    quiet = HostCost(router_s=0.002, replica_s=0.002, cores=1.0, source="test")
    bursty = dataclasses.replace(quiet, burst_cores=0.9, burst_s=1.0, burst_every_s=4.0)

    def summary(host):
        vc = VirtualClock()
        return run(System(AppConfig(**APP), profile, w, 1, vc, host).run(), vc)

    a, b, b2 = summary(quiet), summary(bursty), summary(bursty)
    assert b["trace_sha256"] == b2["trace_sha256"] != a["trace_sha256"]
    assert b["verify_ms"]["p99"] > 1.5 * a["verify_ms"]["p99"] and b["verify_rounds_per_s"] < a["verify_rounds_per_s"]
    (tmp_path / "h.json").write_text('{"router_ms_per_request": 1, "replica_ms_per_request": 1, "cores": 1, '
                                     '"burst_cores": 0.5, "burst_s": 0.8, "burst_every_s": 10}')
    assert (HostCost.load(tmp_path / "h.json").burst_cores, HostCost.load(tmp_path / "h.json").burst_s) == (0.5, 0.8)
    (tmp_path / "h.json").write_text('{"router_ms_per_request": 1, "replica_ms_per_request": 1, "cores": 1, '
                                     '"burst_cores": 0.5, "burst_s": 10, "burst_every_s": 10}')
    with pytest.raises(ProfileError, match="burst_s"):
        HostCost.load(tmp_path / "h.json")
    (tmp_path / "h.json").write_text('{"router_ms_per_request": 1, "replica_ms_per_request": 1, "admit_share": 2}')
    with pytest.raises(ProfileError, match="admit_share"):
        HostCost.load(tmp_path / "h.json")
    # the client's reply share: the router's unless given, within [0, 1]
    (tmp_path / "h.json").write_text('{"router_ms_per_request": 1, "replica_ms_per_request": 1, '
                                     '"client_ms_per_request": 2, "reply_share": 0.25, "client_reply_share": 0.5}')
    h = HostCost.load(tmp_path / "h.json")
    assert h.client_parts_s == pytest.approx((0.001, 0.001)) and h.source == str(tmp_path / "h.json")
    assert HostCost(client_s=0.002, reply_share=0.25).client_parts_s == pytest.approx((0.0015, 0.0005))
    (tmp_path / "h.json").write_text('{"router_ms_per_request": 1, "replica_ms_per_request": 1, '
                                     '"client_reply_share": 1.5}')
    with pytest.raises(ProfileError, match="client_reply_share"):
        HostCost.load(tmp_path / "h.json")


def test_a_client_given_the_cpu_first_waits_less_for_it(tmp_path):
    """HostCost.client_weight: the load generator's claim on the shared cores against a server
    process's. Claiming more, its work takes fewer seconds per CPU second (it waits less behind the
    server's); the CPU it spends is the same. The field loads from a host file;
    0 is refused."""
    from sim.cost_profile import HostCost, ProfileError

    w = Workload(users=12, duration_s=6.0, warmup_s=1.0, max_tokens=24, spawn_rate=20.0,
                 network={"rtt_ms": 30.0, "rtt_sigma": 0.3})
    profile = CostProfile.fit(_profile(model="tiny-random", dtype="float32"), "synthetic")

    def client(weight):
        vc = VirtualClock()
        host = HostCost(router_s=0.004, replica_s=0.004, client_s=0.004, cores=1.0, client_weight=weight, source="t")
        s = System(AppConfig(**APP), profile, w, 1, vc, host)
        run(s.run(), vc)
        return s.client_cpu.slowdown, s.client_cpu.busy_seconds / (s.fleet.calls + s.counters.shed)

    (shared, per_request), (first, per_request_first) = client(1.0), client(8.0)
    assert first < shared / 2
    assert per_request == pytest.approx(0.004, rel=0.1) and per_request_first == pytest.approx(0.004, rel=0.1)
    (tmp_path / "h.json").write_text('{"router_ms_per_request": 1, "replica_ms_per_request": 1, "client_weight": 3}')
    assert HostCost.load(tmp_path / "h.json").client_weight == 3.0
    (tmp_path / "h.json").write_text('{"router_ms_per_request": 1, "replica_ms_per_request": 1, "client_weight": 0}')
    with pytest.raises(ProfileError, match="client_weight"):
        HostCost.load(tmp_path / "h.json")


def test_a_rounds_time_outside_the_router_is_the_clients_own():
    """A load-test user's round, as it times it, is the router's time of it (its Server-Timing) and the
    client's: its request's send and its reply's read, at least their CPU."""
    from sim.cost_profile import HostCost

    w = Workload(users=8, duration_s=6.0, warmup_s=1.0, max_tokens=24, spawn_rate=20.0, client="loadtest",
                 network={"rtt_ms": 30.0, "rtt_sigma": 0.3})
    vc = VirtualClock()
    host = HostCost(router_s=0.001, replica_s=0.001, client_s=0.004, source="t")
    out = run(System(AppConfig(**APP), CostProfile.fit(_profile(model="tiny-random", dtype="float32"), "synthetic"),
                     w, 1, vc, host).run(), vc)
    outside, users = out["verify_outside_router_ms"], out["verify_ms"]
    assert 4.0 - 1e-6 <= outside["p50"] < users["p50"] and outside["p99"] <= users["p99"]


def test_a_shed_user_waits_out_the_retry_after_the_router_sent():
    """As the edge agent and the load test's users: whole seconds, at least 1, at most 30, x U(0.5, 1.5)."""
    import random

    from sim.users import EdgeUser, retry_after_header
    from specdec.errors import Overloaded, SpecError

    u = EdgeUser.__new__(EdgeUser)
    u.rng = random.Random(0)
    waits = {}
    for ra in (None, 0.3, 4.4, 600.0):
        u.retry_after = retry_after_header(SpecError("gone") if ra is None else Overloaded("busy", retry_after=ra))
        waits[ra] = [u._backoff_s() for _ in range(200)]
    assert 0.5 <= min(waits[None]) and max(waits[None]) <= 1.5
    assert 0.5 <= min(waits[0.3]) and max(waits[0.3]) <= 1.5  # the header's whole seconds: at least 1
    assert 2.0 <= min(waits[4.4]) and max(waits[4.4]) <= 6.0
    assert 15.0 <= min(waits[600.0]) and max(waits[600.0]) <= 45.0


def test_the_summary_says_where_users_wait_as_the_load_test_reports_it():
    """waits: each 429's Retry-After by reason, the users waiting one out by the request it answered
    (user-seconds inside the window over its length) and the sessions the replicas hold (sampled as
    loadtests.server samples a served replica): 40 users on a router that lets 6 requests in flight
    wait mostly to open, told longer and longer Retry-Afters (the adaptive one)."""
    w = Workload(users=40, duration_s=8.0, warmup_s=1.0, max_tokens=24, spawn_rate=20.0,
                 network={"rtt_ms": 30.0, "rtt_sigma": 0.3})
    vc = VirtualClock()
    s = System(AppConfig(**APP, router={"max_pending_verifies": 6}),
               CostProfile.fit(_profile(model="tiny-random", dtype="float32"), "synthetic"), w, 0, vc)
    out = run(s.run(), vc)
    waits = out["waits"]
    told = waits["retry_after_s"]["new_sessions_paused"]
    assert 0 < told["n"] <= out["shed_429"] and told["p50"] >= 1.0 and told["max"] > 1.0
    assert len(s.sessions_held) == 29 and waits["sessions_held"] == sum(s.sessions_held) / 29  # 1-8 s, every 0.25
    assert 0 < waits["sessions_held"] < waits["users_waiting_retry_after"]["open"] <= 40
