"""The served system in virtual time: the production Router and VerifierServer replicas, driven by
simulated edge users (issue 61).

What runs is the production code: :class:`deploy.router.ingress.Router` (tenants, quotas,
admission, fast shedding, open deadlines), :class:`deploy.router.affinity.SessionAffinityRouter`
(which replica an open goes to; a session stays on its replica) and one
:class:`deploy.verifier.server.VerifierServer` per replica (batch loop, batch fill, pacing
hints, run-ahead, truncation, eviction, prefill budget) over the production engine. What is
modelled, and only this: the target forward (:mod:`sim.target`, seconds from a cost
profile), the drafts (:mod:`loadtests.synthetic_tree`: tree levels right with the workload's
acceptance), the network (per-user RTT, jitter, spikes) and the users' timing
(:mod:`sim.workload`); faults (replica kills, bursts, vanishing users) are seeded events. The HTTP/ASGI layer is not simulated: a request reaches the
router's fast path and handler directly. Everything random draws from one seed.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from ray.exceptions import RayActorError

from benchmarks.metrics import weighted_percentile
from benchmarks.model_shapes import SHAPES
from deploy.config import AppConfig
from deploy.router.affinity import SessionAffinityRouter, replica_of
from deploy.router.fast_shed import admission_refusal
from deploy.router.ingress import Router
from deploy.verifier.server import VerifierServer
from deploy.verifier.pipeline_stage import ModelShell, target_config
from deploy.verifier.stats_window import mean_figures, window_figures
from loadtests.report import retry_after_summary
from sim.cost_profile import CostProfile, HostCost
from sim.fairness import TenantShares
from sim.target import SIM_VOCAB, SimRunner
from sim.users import Counters, DraftDevices, EdgeUser
from sim.virtual_time import SharedCores, VirtualClock, VirtualWorker, bursts
from sim.workload import Workload
from specdec import clock
from specdec.protocol import VerifyFrame
from specdec.model.checkpoint import CheckpointConfig
from specdec.model.loading import LoadedModel

CALLS = {"info": "model_info", "get_stats": "stats"}  # the Serve replica's names of VerifierServer methods
SESSIONS_EVERY_S = 0.25  # how often the sessions the replicas hold are sampled (loadtests/server.py's period)


@dataclass
class Trace:
    """Every request's outcome, in order: (virtual time, user, kind, status, server seconds, tokens)."""

    events: list[tuple] = field(default_factory=list)

    def add(self, *event) -> None:
        self.events.append(event)

    def digest(self) -> str:
        return hashlib.sha256(repr(self.events).encode()).hexdigest()


class Fleet:
    """M verifier replicas, each a production :class:`VerifierServer` on a simulated target and a
    virtual worker, behind the handle the Router calls (``handle.method.remote(**kwargs)``)."""

    def __init__(self, app: AppConfig, profile: CostProfile, vc: VirtualClock, loop, rng: random.Random,
                 host: HostCost = HostCost(), shares: TenantShares | None = None, cores: SharedCores | None = None):
        name = app.target.model  # a shape of benchmarks/model_shapes.py, or a target the replica would load
        self.shell_cfg = CheckpointConfig.from_dict(dict(SHAPES[name])) if name in SHAPES else target_config(app.target)
        self.shell_cfg.vocab_size = SIM_VOCAB  # the synthetic target's ids; its cost is the profile's
        self.app, self.profile, self.vc, self.loop, self.rng = app, profile, vc, loop, rng
        self.shares = shares if shares is not None else TenantShares({})
        self.host = host  # the replica's CPU outside the model: per request on its loop, per forward on its worker
        self.cores = cores  # the host's CPUs, shared by the replicas' workers with the router and client
        self.read_reply = None  # () -> awaitable: the router's CPU reading a replica's reply (HostCost)
        self.send = None  # () -> awaitable: the router's CPU sending an admitted call (HostCost.admit_share)
        self.replicas: dict[str, VerifierServer] = {}
        self.runners: dict[str, SimRunner] = {}  # every replica that ran, killed ones included
        self.inflight: dict[str, set[asyncio.Task]] = {}
        self.loop_cpu: dict[str, VirtualWorker] = {}  # each replica's event loop (HostCost.replica_s)
        self.killed: set[str] = set()
        for i in range(app.verifier.num_replicas):
            self.start(f"r{i}")
        self.affinity = SessionAffinityRouter.__new__(SessionAffinityRouter)
        self.affinity.initialize_state(app.verifier.version_affinity_margin)
        self.calls = 0

    def start(self, tag: str) -> None:
        """A new replica (as Serve starts one): its own engine, worker and empty KV."""
        runner = SimRunner(self.profile, self.vc.spend, self.app.verifier.kv_pool_tokens(),
                           rng=random.Random(self.rng.getrandbits(64)))
        loaded = LoadedModel(ModelShell(self.shell_cfg), None, f"sim:{self.app.target.model}", (0,), "cpu",
                             torch.bfloat16)
        worker = VirtualWorker(self.loop, self.cores)
        self.replicas[tag] = VerifierServer(self.app, tag, runner, loaded, executor=worker,
                                          new_id=lambda: f"{self.rng.getrandbits(64):016x}")
        self.runners[tag] = runner
        self.inflight[tag] = set()
        self.loop_cpu[tag] = VirtualWorker(self.loop, self.cores)
        if self.host.forward_s:
            self._charge_forwards(self.replicas[tag].engine)
        self._observe_shares(self.replicas[tag].loop.sched)

    def _charge_forwards(self, engine) -> None:
        """Each forward costs the replica ``HostCost.forward_s`` more, after the forward's own clock
        read (the pacer's cost curve sees the model's time alone, as in a served replica)."""
        observed = engine.on_forward

        def on_forward(st) -> None:
            observed(st)
            self.vc.spend(self.host.forward_s)

        engine.on_forward = on_forward

    def _observe_shares(self, sched) -> None:
        """Count each forward's tokens by tenant, and who it left waiting (:mod:`sim.fairness`)."""
        take = sched.take

        def observed(max_sessions: int, max_tokens: int):
            batch = take(max_sessions, max_tokens)
            if batch:
                got: dict[str, int] = {}
                for p in batch:
                    got[p.tenant] = got.get(p.tenant, 0) + p.tokens
                self.shares.observe(got, sched.pending_by_tenant())
            return batch

        sched.take = observed

    def kill(self, tag: str) -> None:
        """The replica dies: its batch loop stops, its calls in flight fail as Ray's do (the router
        answers them 503), its sessions are gone (their edges re-open from their history)."""
        core = self.replicas.pop(tag)
        self.killed.add(tag)
        if core.loop.task is not None:
            core.loop.task.cancel()
        for task in self.inflight.pop(tag, set()):
            task.cancel()

    def idle(self) -> bool:
        """No replica has a verify round or an open waiting."""
        return all(core.pending() == 0 for core in self.replicas.values())

    def __getattr__(self, method: str):
        return SimpleNamespace(remote=lambda **kwargs: self._call(method, kwargs))

    async def _call(self, method: str, kwargs: dict):
        self.calls += 1
        if self.send is not None and method in ("open_session", "verify", "close_session"):
            await self.send()  # the router's process sends the call, the request already in flight
        core = await self._route(kwargs)
        if method in ("open_session", "verify", "close_session"):
            tree = method == "verify" and VerifyFrame.header(kwargs["frame"]).nodes > 0
            # on the replica's event loop, beside its forward thread (sharing the cores, as a GIL-free forward does)
            await _spend(self.loop_cpu[core.tag], self.host.replica_s + (self.host.replica_tree_s if tree else 0.0))
        fn = getattr(core, CALLS.get(method, method))
        out = fn(**kwargs) if method not in CALLS else fn()
        if not asyncio.iscoroutine(out):
            return out
        task = asyncio.ensure_future(out)
        calls = self.inflight[core.tag]
        calls.add(task)
        try:
            out = await task
        except asyncio.CancelledError:
            if core.tag in self.killed:
                raise RayActorError() from None
            raise
        finally:
            calls.discard(task)
        if self.read_reply is not None and method in ("open_session", "verify", "close_session"):
            await self.read_reply()  # the router's process reads the reply while the request is in flight
        return out

    async def _route(self, kwargs: dict) -> VerifierServer:
        """The replica Serve's request router would pick: the session's own, else by load."""
        own = self.replicas.get(replica_of(str(kwargs.get("session_id") or "")) or "")
        if own is not None:  # what choose_replicas answers for a live replica's session, without its O(M) ranking
            return own
        stand_ins = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=tag),
                                     routing_stats={"sessions": len(c.engine.sessions), "pending": c.pending(),
                                                    "kv_tokens": c.engine.kv_tokens(), "adapters": []})
                     for tag, c in self.replicas.items()]
        pending = SimpleNamespace(kwargs=kwargs, routing_context=SimpleNamespace(should_backoff=False))
        ranks = await self.affinity.choose_replicas(stand_ins, pending)
        chosen = ranks[0][0]
        if not kwargs.get("session_id"):
            self.affinity.on_request_routed(pending, chosen.replica_id, None)
        return self.replicas[chosen.replica_id.unique_id]


class System:
    """The router, the fleet and the users of one simulation."""

    def __init__(self, app: AppConfig, profile: CostProfile, workload: Workload, seed: int, vc: VirtualClock,
                 host: HostCost = HostCost()):
        app = app.model_copy(deep=True)
        app.verifier.warmup = False  # the warm-up's one-time costs are not in the cost model
        app.router.loop_stall_log_s = 0.0  # no watchdog thread: nothing runs off the virtual loop
        profile.check(app.target.model, app.target.dtype if app.target.dtype != "auto" else profile.dtype)
        self.app, self.profile, self.workload, self.seed, self.vc, self.host = app, profile, workload, seed, vc, host
        self.rng = random.Random(seed)
        self.trace = Trace()
        self.counters = Counters()
        self.replicas_at_window: dict[str, dict] = {}  # tag -> its counters where the window starts
        self.replicas_at_window_end: dict[str, dict] = {}  # ... where it ends (an open run; else at the summary)
        self.sessions_held: list[int] = []  # the replicas' sessions, sampled over the window
        self.devices = DraftDevices(workload.edge_workers)
        self.rtt_factor = 1.0  # an RTT spike multiplies every user's round trip
        keys = {t.name: t for t in app.router.load_tenants()}
        for name in workload.tenants:
            if name not in keys and not (name == "default" and not app.router.tenants):
                raise ValueError(f"workload tenants: {name!r} is not a tenant of the deployment "
                                 f"({sorted(keys)})")
        for i, f in enumerate(workload.faults):
            if f.kind == "kill_replica" and f.replica >= app.verifier.num_replicas:
                raise ValueError(f"workload faults[{i}].replica: {f.replica}, but the deployment has "
                                 f"{app.verifier.num_replicas} replica(s)")

    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        random.seed(self.seed)  # ties in the affinity router's ordering draw from the global generator
        weights = {t.name: t.weight for t in self.app.router.load_tenants()}
        cores = SharedCores(loop, self.host.shared_cores) if self.host.shared_cores else None
        self.fleet = Fleet(self.app, self.profile, self.vc, loop, self.rng, self.host, TenantShares(weights),
                           cores)
        self.router_cpu = VirtualWorker(loop, cores)  # the router's process: one request's work at a time
        self.client_cpu = VirtualWorker(loop, cores, self.host.client_weight)  # the load generator's (HostCost.client_s)
        _, send_s, reply_s = self.host.router_parts_s
        if reply_s:
            self.fleet.read_reply = lambda: _spend(self.router_cpu, reply_s)
        if send_s:
            self.fleet.send = lambda: _spend(self.router_cpu, send_s)
        cls = next(c for c in Router.func_or_class.__mro__[1:] if c.__name__ == "Router")
        self.router = cls.__new__(cls)
        cls.__init__(self.router, self.fleet, self.app.model_dump())
        self.router.probe.on_verify = self._router_verify
        self.users = [EdgeUser(self, i, random.Random(self.rng.getrandbits(64))) for i in range(self.workload.users)]
        self.tasks = [asyncio.ensure_future(u.run(self.workload.duration_s)) for u in self.users]
        faults = asyncio.ensure_future(self._faults())
        window = self.workload.warmup_s if self.workload.generations_per_user is None else 0.0
        loop.call_later(window, self._snapshot_replicas, self.replicas_at_window)
        if self.workload.generations_per_user is None:  # the window ends before the generations in flight do
            loop.call_later(self.workload.duration_s, self._snapshot_replicas, self.replicas_at_window_end)
        held = asyncio.ensure_future(self._sample_sessions(window))
        burst = None
        if cores is not None and self.host.burst_cores:  # the first burst at a phase drawn from the seed
            h = self.host
            burst = asyncio.ensure_future(bursts(cores, h.burst_cores, h.burst_s, h.burst_every_s,
                                                 random.Random(f"bursts-{self.seed}").uniform(0, h.burst_every_s)))
        while not all(t.done() for t in self.tasks):  # a burst adds users on the way
            await asyncio.gather(*self.tasks)
        faults.cancel()
        held.cancel()
        if burst is not None:
            burst.cancel()
        for core in self.fleet.replicas.values():
            if core.loop.task is not None:
                core.loop.task.cancel()
        return self.summary()

    async def _faults(self) -> None:
        """The workload's seeded events, in time order."""
        w, killed = self.workload, 0
        for f in sorted(w.faults, key=lambda f: f.at_s):
            await clock.sleep(max(0.0, f.at_s - clock.monotonic()))
            self.trace.add(round(clock.monotonic(), 9), -1, f.kind, 0, 0.0)
            if f.kind == "kill_replica":
                tag = sorted(self.fleet.replicas)[min(f.replica, len(self.fleet.replicas) - 1)]
                self.fleet.kill(tag)
                killed += 1
                if f.restart_after_s is not None:
                    asyncio.get_running_loop().call_later(f.restart_after_s, self.fleet.start, f"{tag}x{killed}")
            elif f.kind == "rtt_spike":
                self.rtt_factor *= f.factor
                asyncio.get_running_loop().call_later(f.for_s, self._rtt_back, f.factor)
            elif f.kind == "burst":
                n = len(self.users)
                for i in range(n, n + f.users):
                    u = EdgeUser(self, i, random.Random(self.rng.getrandbits(64)), spawn=False)
                    self.users.append(u)
                    self.tasks.append(asyncio.ensure_future(u.run(w.duration_s)))
            else:  # vanish: a share of the users drop their session mid-generation, unclosed, and stop
                for u in self.rng.sample(self.users, max(1, round(f.share * len(self.users)))):
                    u.vanished = True

    async def _sample_sessions(self, start: float) -> None:
        """The sessions the live replicas hold, every :data:`SESSIONS_EVERY_S` of the window (as
        ``loadtests.server`` samples a served replica's ``/v1/stats``)."""
        await clock.sleep(start)
        while clock.monotonic() <= self.workload.duration_s:
            self.sessions_held.append(sum(len(core.engine.sessions) for core in self.fleet.replicas.values()))
            await clock.sleep(SESSIONS_EVERY_S)

    def _snapshot_replicas(self, into: dict[str, dict]) -> dict[str, dict]:
        """Each live replica's counters now, into ``into`` (returned), where the summary's window starts or
        ends (:func:`window_figures`)."""
        into.update((tag, core.counters.to_dict()) for tag, core in self.fleet.replicas.items())
        return into

    def _router_verify(self, seconds: float) -> None:
        """The router's own time of an admitted verify round's verifier call (deploy/router/probe.py)."""
        if clock.monotonic() >= self.workload.warmup_s:
            self.counters.router_verify_s.append(seconds)

    def _rtt_back(self, factor: float) -> None:
        self.rtt_factor /= factor

    async def router_work(self) -> None:
        """A request's CPU in the router's process before its admission (``HostCost.router_s`` less
        its reply's share, of which ``admit_share``), after those before it."""
        await _spend(self.router_cpu, self.host.router_parts_s[0])

    async def client_work(self, reply: bool) -> None:
        """The load generator's CPU for a request (``HostCost.client_s``): sending it, or (``reply``)
        reading its reply; after the work queued before it."""
        await _spend(self.client_cpu, self.host.client_parts_s[reply])

    def fast_shed(self, method: str, path: str, tenant):
        """The router's fast path (deploy/router/fast_shed.py) for a request of ``tenant`` (its key
        checked: the simulation holds the tenant itself, not its plain key)."""
        return admission_refusal(method, path, "sim", SimpleNamespace(authenticate=lambda _: tenant),
                                 self.router.admission)

    # -- figures ------------------------------------------------------------------------
    def replica_window(self) -> dict | None:
        """The replicas' own figures over the summary's window (:func:`window_figures`, their mean), from
        the counters of the replicas live where it starts and where it ends, as the load test samples them."""
        ends = self.replicas_at_window_end or self._snapshot_replicas({})
        return mean_figures([window_figures(before, ends[tag]) for tag, before in self.replicas_at_window.items()
                             if tag in ends])

    def summary(self) -> dict:
        c, w = self.counters, self.workload
        closed = w.generations_per_user is not None  # a closed run: its figures are over the whole run
        window = c.last_token_at if closed else w.duration_s - w.warmup_s
        tokens, rounds = (c.tokens, c.rounds) if closed else (c.window_tokens, c.window_rounds)
        lat, router, outside = sorted(c.round_s), sorted(c.router_verify_s), sorted(c.outside_s)
        busy = {tag: r.busy_seconds for tag, r in self.fleet.runners.items()}
        return {"users": len(self.users), "mode": w.mode, "replicas": len(self.fleet.replicas),
                "replicas_killed": len(self.fleet.killed), "seed": self.seed,
                "simulated_s": clock.monotonic(), "window_s": window, "profile": self.profile.source,
                "device": self.profile.device, "host_cost": self.host.source or None, "verified_tokens_per_s": tokens / window if window else 0.0,
                "verify_rounds_per_s": rounds / window if window else 0.0,
                "verify_ms": {"p50": _pct(lat, 50) * 1e3, "p99": _pct(lat, 99) * 1e3},
                "router_verify_ms": {"p50": _pct(router, 50) * 1e3, "p99": _pct(router, 99) * 1e3},
                "verify_outside_router_ms": {"p50": _pct(outside, 50) * 1e3, "p99": _pct(outside, 99) * 1e3},
                "itl_ms": {"p50": weighted_percentile(c.itl, 50) * 1e3, "p99": weighted_percentile(c.itl, 99) * 1e3},
                "ttft_ms_mean": 1e3 * sum(c.ttft_s) / len(c.ttft_s) if c.ttft_s else float("nan"),
                "ttft_ms_p99": _pct(sorted(c.ttft_s), 99) * 1e3,
                "shed_fraction": c.shed / max(1, c.shed + c.rounds + c.generations),
                "tokens_per_round": tokens / rounds if rounds else 0.0,
                "drafted_per_round": c.window_drafted / c.window_rounds if c.window_rounds else 0.0,
                "depth_per_round": c.window_depth / c.window_rounds if c.window_rounds else 0.0,
                "generations": c.generations, "finished": c.outcomes.get("finished", 0) + c.outcomes.get("finished_short", 0), "shed_429": c.shed,
                "shed_reasons": dict(sorted(c.shed_reasons.items())),
                "waits": waits(c, self.sessions_held, window),
                "errors": c.errors,
                "diverged_rounds": c.diverged, "reopens": c.reopens, "opens_refused_while_idle": c.open_refused_idle,
                "replica_busy_fraction": {t: b / max(clock.monotonic(), 1e-9) for t, b in busy.items()},
                "replica_window": self.replica_window(),
                "forwards": sum(r.forwards for r in self.fleet.runners.values()),
                "outcomes": dict(sorted(c.outcomes.items())), "max_gap_s": c.max_gap_s,
                "tenant_shares": self.fleet.shares.ratios(),
                "invariants": self.invariants(),
                "trace_events": len(self.trace.events), "trace_sha256": self.trace.digest()}

    def invariants(self) -> dict[str, bool]:
        """What must hold whatever the load and the faults (issue 61, item 7)."""
        c, w = self.counters, self.workload
        return {"no_open_refused_while_idle": c.open_refused_idle == 0,
                "no_token_lost_or_duplicated": c.diverged == 0 and c.outcomes.get("finished_short", 0) == 0,
                "every_generation_accounted": sum(c.outcomes.values()) == c.generations,
                "no_error_status": c.errors == 0,
                "no_session_starved": c.max_gap_s <= w.max_gap_s,
                "tenant_shares_by_weight": self.fleet.shares.within(w.share_tolerance)}


def waits(c: Counters, sessions_held: list[int], window_s: float) -> dict:
    """Where the users wait in the window, as ``loadtests.report.waits`` reports a load test: the 429s'
    Retry-After by reason (s), the users waiting one out on average by the request it answered, and
    the sessions the replicas hold on average."""
    return {"retry_after_s": retry_after_summary(c.retry_after_s),
            "users_waiting_retry_after": {k: v / window_s for k, v in sorted(c.waiting_s.items())} if window_s else {},
            "sessions_held": sum(sessions_held) / len(sessions_held) if sessions_held else None}


async def _spend(worker: VirtualWorker, seconds: float) -> None:
    """``seconds`` of CPU in ``worker``'s process, after the work queued there before it."""
    if seconds:
        await asyncio.get_running_loop().run_in_executor(worker, worker.clock.spend, seconds)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]
