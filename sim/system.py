"""The served system in virtual time: the production Router and VerifierCore replicas, driven by
simulated edge users (issue 61).

What runs is the production code: :class:`deploy.router.ingress.Router` (tenants, quotas,
admission, fast shedding, open deadlines), :class:`deploy.router.affinity.SessionAffinityRouter`
(which replica an open goes to; a session stays on its replica) and one
:class:`deploy.verifier.deployment.VerifierCore` per replica (batch loop, batch fill, pacing
hints, run-ahead, truncation, eviction, prefill budget) over the production engine. What is
modelled, and only this: the target forward (:mod:`sim.target`, seconds from a cost
profile), the drafts (:mod:`loadtests.synthetic_tree`: tree levels right with the workload's
acceptance), the network (per-user RTT, jitter, drops) and the users' timing
(:mod:`sim.workload`). The HTTP/ASGI layer is not simulated: a request reaches the
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

from deploy.config import AppConfig
from deploy.router.affinity import SessionAffinityRouter
from deploy.router.fast_shed import admission_refusal
from deploy.router.ingress import Router
from sim.cost_profile import CostProfile
from sim.target import SIM_VOCAB, SimRunner, continuation
from sim.virtual_time import VirtualClock, VirtualWorker
from sim.workload import Workload
from deploy.verifier.deployment import VerifierCore
from deploy.verifier.pipeline_stage import ModelShell, target_config
from loadtests.synthetic_tree import AcceptanceModel, synthetic_tree
from specdec import clock
from specdec.errors import SpecError
from specdec.model.loading import LoadedModel
from specdec.protocol import ReplyFrame, VerifyFrame

CALLS = {"info": "model_info", "get_stats": "stats"}  # the Serve replica's names of VerifierCore methods


@dataclass
class Trace:
    """Every request's outcome, in order: (virtual time, user, kind, status, server seconds, tokens)."""

    events: list[tuple] = field(default_factory=list)

    def add(self, *event) -> None:
        self.events.append(event)

    def digest(self) -> str:
        return hashlib.sha256(repr(self.events).encode()).hexdigest()


class Fleet:
    """M verifier replicas, each a production :class:`VerifierCore` on a simulated target and a
    virtual worker, behind the handle the Router calls (``handle.method.remote(**kwargs)``)."""

    def __init__(self, app: AppConfig, profile: CostProfile, vc: VirtualClock, loop, rng: random.Random):
        shell_cfg = target_config(app.target)
        shell_cfg.vocab_size = SIM_VOCAB  # the synthetic target's ids; its cost is the profile's
        self.replicas: dict[str, VerifierCore] = {}
        self.runners: dict[str, SimRunner] = {}
        for i in range(app.verifier.num_replicas):
            tag = f"r{i}"
            runner = SimRunner(profile, vc.spend, app.verifier.kv_pool_tokens())
            loaded = LoadedModel(ModelShell(shell_cfg), None, f"sim:{app.target.model}", (0,), "cpu", torch.bfloat16)
            self.replicas[tag] = VerifierCore(app, tag, runner, loaded, executor=VirtualWorker(loop),
                                              new_id=lambda: f"{rng.getrandbits(64):016x}")
            self.runners[tag] = runner
        self.affinity = SessionAffinityRouter.__new__(SessionAffinityRouter)
        self.affinity.initialize_state(app.verifier.version_affinity_margin)
        self.calls = 0

    def __getattr__(self, method: str):
        return SimpleNamespace(remote=lambda **kwargs: self._call(method, kwargs))

    async def _call(self, method: str, kwargs: dict):
        self.calls += 1
        core = await self._route(kwargs)
        fn = getattr(core, CALLS.get(method, method))
        out = fn(**kwargs) if method not in CALLS else fn()
        return await out if asyncio.iscoroutine(out) else out

    async def _route(self, kwargs: dict) -> VerifierCore:
        """The replica Serve's request router would pick: the session's own, else by load."""
        stand_ins = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=tag),
                                     routing_stats={"sessions": len(c.engine.sessions), "pending": c.pending(),
                                                    "kv_tokens": c.engine.kv_tokens(), "adapters": []})
                     for tag, c in self.replicas.items()]
        pending = SimpleNamespace(kwargs=kwargs)
        ranks = await self.affinity.choose_replicas(stand_ins, pending)
        chosen = ranks[0][0]
        if not kwargs.get("session_id"):
            self.affinity.on_request_routed(pending, chosen.replica_id, None)
        return self.replicas[chosen.replica_id.unique_id]


@dataclass
class Counters:
    generations: int = 0
    finished: int = 0
    tokens: int = 0
    rounds: int = 0
    shed: int = 0
    errors: int = 0
    diverged: int = 0
    reopens: int = 0
    round_s: list[float] = field(default_factory=list)  # server time of each admitted verify round (window)
    window_tokens: int = 0
    window_rounds: int = 0
    open_refused_idle: int = 0


class System:
    """The router, the fleet and the users of one simulation."""

    def __init__(self, app: AppConfig, profile: CostProfile, workload: Workload, seed: int, vc: VirtualClock):
        app = app.model_copy(deep=True)
        app.verifier.warmup = False  # the warm-up's one-time costs are not in the cost model
        app.router.loop_stall_log_s = 0.0  # no watchdog thread: nothing runs off the virtual loop
        profile.check(app.target.model, app.target.dtype if app.target.dtype != "auto" else profile.dtype)
        self.app, self.profile, self.workload, self.seed, self.vc = app, profile, workload, seed, vc
        self.rng = random.Random(seed)
        self.trace = Trace()
        self.counters = Counters()
        keys = {t.name: t for t in app.router.load_tenants()}
        for name in workload.tenants:
            if name not in keys and not (name == "default" and not app.router.tenants):
                raise ValueError(f"workload tenants: {name!r} is not a tenant of the deployment "
                                 f"({sorted(keys)})")

    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        random.seed(self.seed)  # ties in the affinity router's ordering draw from the global generator
        self.fleet = Fleet(self.app, self.profile, self.vc, loop, self.rng)
        cls = next(c for c in Router.func_or_class.__mro__[1:] if c.__name__ == "Router")
        self.router = cls.__new__(cls)
        cls.__init__(self.router, self.fleet, self.app.model_dump())
        w = self.workload
        end = w.duration_s
        users = [asyncio.ensure_future(self._user(i, end)) for i in range(w.users)]
        await asyncio.gather(*users)
        for core in self.fleet.replicas.values():
            if core.loop.task is not None:
                core.loop.task.cancel()
        return self.summary()

    # -- one simulated edge agent -------------------------------------------------------
    async def _user(self, i: int, end: float) -> None:
        w, rng = self.workload, random.Random(self.rng.getrandbits(64))
        tenant_name = _pick(rng, w.tenants)
        tenant = self.router.tenants.by_name.get(tenant_name) or next(iter(self.router.tenants.by_name.values()))
        device = _pick(rng, w.devices)
        draft_ms = w.device_ms()[device]
        rtt_s = w.network.rtt_ms / 1000.0 * (math.exp(rng.gauss(0.0, w.network.rtt_sigma)) if w.network.rtt_sigma else 1.0)
        model = AcceptanceModel(w.acceptance.alpha, w.acceptance.sibling_alpha)
        if w.spawn_rate:
            await clock.sleep(i / w.spawn_rate)
        while clock.monotonic() < end:
            await self._generation(i, rng, tenant, draft_ms, rtt_s, model, end)
            await clock.sleep(rng.uniform(*w.think_s))

    def _net(self, rng: random.Random, rtt_s: float) -> float:
        j = self.workload.network.jitter
        return rtt_s / 2 * rng.uniform(1 - j, 1 + j)

    async def _generation(self, i, rng, tenant, draft_ms, rtt_s, model, end) -> None:
        w, c = self.workload, self.counters
        prompt = [rng.randrange(3, SIM_VOCAB) for _ in range(rng.randint(*w.prompt_tokens))]
        truth = continuation(prompt, w.max_tokens)
        c.generations += 1
        d = await self._open(i, rng, tenant, prompt, [], rtt_s, end)
        if d is None:
            return
        out = [d["first_token"]] if d["first_token"] is not None else []
        sid, prefix_len, finished = d["session_id"], d["prefix_len"], d["finished"]
        depth_hint, budget_hint = d["depth_hint"], d["budget_hint"]
        vcfg = self.app.verifier
        while not finished and clock.monotonic() < end:
            if w.mode == "edge":
                nodes = min(w.nodes or max(1, budget_hint), vcfg.max_tree_nodes)
                depth = min(w.depth or max(1, depth_hint), nodes, vcfg.max_tree_depth)
                rest = truth[len(out):]
                tokens, parents, _ = synthetic_tree(rest, model, depth, nodes, SIM_VOCAB, rng)
                await clock.sleep(depth * draft_ms / 1000.0 * rng.uniform(1 - w.network.jitter, 1 + w.network.jitter))
            else:
                tokens, parents, depth = [], [], 0
            frame = VerifyFrame(prefix_len, tokens, parents, draft_ms=draft_ms, rtt_ms=rtt_s * 1000.0,
                                depth=depth).encode()
            await clock.sleep(self._net(rng, rtt_s))
            status, reply, took = await self._verify(tenant, sid, frame)
            await clock.sleep(self._net(rng, rtt_s))
            self.trace.add(round(clock.monotonic(), 9), i, "verify", status, round(took, 9))
            if status == 200:
                new = [tokens[j] for j in reply.accepted] + ([reply.bonus] if reply.bonus is not None else [])
                if new != truth[len(out):len(out) + len(new)]:
                    c.diverged += 1
                out.extend(new)
                c.rounds += 1
                c.tokens += len(new)
                if clock.monotonic() >= w.warmup_s:
                    c.round_s.append(took)
                    c.window_rounds += 1
                    c.window_tokens += len(new)
                prefix_len, finished = reply.prefix_len, reply.finished
                depth_hint, budget_hint = reply.depth_hint or depth_hint, reply.budget_hint or budget_hint
            elif status in (429, 503):
                c.shed += 1
                await clock.sleep(1.0 * rng.uniform(0.5, 1.5))
            elif status in (404, 410):
                c.reopens += 1
                d = await self._open(i, rng, tenant, prompt, out, rtt_s, end)
                if d is None:
                    return
                sid, prefix_len, finished = d["session_id"], d["prefix_len"], d["finished"]
                if d["first_token"] is not None:
                    out.append(d["first_token"])
            else:
                c.errors += 1
                return
        if finished:
            c.finished += 1
            if not d.get("close_on_finish"):
                await self.router.close(tenant, sid)
        else:
            try:
                await self.router.close(tenant, sid)
            except SpecError:
                pass

    async def _open(self, i, rng, tenant, prompt, generated, rtt_s, end) -> dict | None:
        body = {"prompt_ids": prompt, "generated_ids": generated, "sampling": {"max_tokens": self.workload.max_tokens},
                "client": {"draft_ms": 0.0, "rtt_ms": rtt_s * 1000.0}, "close_on_finish": True}
        while clock.monotonic() < end:
            await clock.sleep(self._net(rng, rtt_s))
            t0 = clock.monotonic()
            idle = all(core.pending() == 0 for core in self.fleet.replicas.values())
            shed = self._fast_shed("POST", "/v1/sessions", tenant)
            try:
                if shed is not None:
                    raise shed
                d = await self.router.open(tenant, body, received_at=clock.perf_counter())
                status = 200
            except SpecError as e:
                d, status = None, e.status
                if status == 429 and idle and getattr(e, "reason", "").startswith("open_deadline"):
                    self.counters.open_refused_idle += 1
            await clock.sleep(self._net(rng, rtt_s))
            self.trace.add(round(clock.monotonic(), 9), i, "open", status, round(clock.monotonic() - t0, 9))
            if status == 200:
                return d
            if status not in (429, 503):
                self.counters.errors += 1
                return None
            self.counters.shed += 1
            await clock.sleep(rng.uniform(0.5, 1.5))
        return None

    async def _verify(self, tenant, sid: str, frame: bytes):
        t0 = clock.monotonic()
        shed = self._fast_shed("POST", f"/v1/sessions/{sid}/verify", tenant)
        try:
            if shed is not None:
                raise shed
            payload = await self.router.verify(tenant, sid, frame)
            return 200, ReplyFrame.decode(payload), clock.monotonic() - t0
        except SpecError as e:
            return e.status, None, clock.monotonic() - t0

    def _fast_shed(self, method: str, path: str, tenant):
        """The router's fast path (deploy/router/fast_shed.py) for a request of ``tenant`` (its key
        checked: the simulation holds the tenant itself, not its plain key)."""
        return admission_refusal(method, path, "sim", SimpleNamespace(authenticate=lambda _: tenant),
                                 self.router.admission)

    # -- figures ------------------------------------------------------------------------
    def summary(self) -> dict:
        c, w = self.counters, self.workload
        window = w.duration_s - w.warmup_s
        lat = sorted(c.round_s)
        busy = {tag: r.busy_seconds for tag, r in self.fleet.runners.items()}
        return {"users": w.users, "mode": w.mode, "replicas": len(self.fleet.replicas), "seed": self.seed,
                "simulated_s": w.duration_s, "window_s": window, "profile": self.profile.source,
                "device": self.profile.device, "verified_tokens_per_s": c.window_tokens / window,
                "verify_rounds_per_s": c.window_rounds / window,
                "verify_ms": {"p50": _pct(lat, 50) * 1e3, "p99": _pct(lat, 99) * 1e3},
                "tokens_per_round": c.window_tokens / c.window_rounds if c.window_rounds else 0.0,
                "generations": c.generations, "finished": c.finished, "shed_429": c.shed, "errors": c.errors,
                "diverged_rounds": c.diverged, "reopens": c.reopens, "opens_refused_while_idle": c.open_refused_idle,
                "replica_busy_fraction": {t: b / w.duration_s for t, b in busy.items()},
                "forwards": sum(r.forwards for r in self.fleet.runners.values()),
                "trace_events": len(self.trace.events), "trace_sha256": self.trace.digest()}


def _pick(rng: random.Random, shares: dict[str, float]) -> str:
    names = sorted(shares)
    return rng.choices(names, weights=[shares[n] for n in names])[0]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]
