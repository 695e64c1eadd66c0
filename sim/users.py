"""Simulated edge agents: each opens a session, drafts trees with the workload's acceptance, sends
them over its network and chooses each tree's depth and size as the edge agent does (SpecEdge
§4.2-4.3): its own :class:`edge_agent.depth.DepthPolicy` on its own :class:`Telemetry` (draft time
per forward, pinged RTT, rounds), under the server's depth and budget hints and the agent's budget;
or as the load test's Locust user does (``client: loadtest``: the server's hints); or, in
``server_ar`` mode, streams what the server decodes.

Draft forwards run on the user's own device, or on ``edge_workers`` shared ones (one edge core
serving every session, as ``benchmarks.run`` does). With ``proactive`` the next tree is drafted
while the current one is verified and used when the whole tree was accepted (SpecEdge §4.2);
otherwise it is drafted after the reply. What a user sees is recorded as the benchmarks record it:
ITL samples per delivered batch (:func:`benchmarks.metrics.itl_samples`) and the time to the
first token.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field

from edge_agent.config import AgentConfig
from edge_agent.depth import DepthPolicy, Telemetry
from loadtests.report import seconds_inside
from loadtests.synthetic_tree import AcceptanceModel, synthetic_tree
from sim.target import SIM_VOCAB, continuation
from specdec import clock
from specdec.errors import Overloaded, SpecError
from specdec.protocol import ReplyFrame, VerifyFrame
from specdec.truncation import encode_confidence

MAX_RETRY_AFTER_S = 30.0  # the longest Retry-After honoured (edge_agent.transport.http.RetryPolicy, loadtests)
AGENT = AgentConfig()  # the edge agent's defaults: its tree shape (topk, max_expand), depth cap, ping period


@dataclass
class Counters:
    generations: int = 0
    tokens: int = 0
    rounds: int = 0
    shed: int = 0
    errors: int = 0
    diverged: int = 0
    reopens: int = 0
    round_s: list[float] = field(default_factory=list)  # each admitted verify round as its user times it (window)
    # of each, the time outside the router (the user's less the router's, from its loop's read of the request to
    # its reply: the Server-Timing a served router states): the client's CPU and waits (window)
    outside_s: list[float] = field(default_factory=list)
    router_verify_s: list[float] = field(default_factory=list)  # its verifier call as the router times it (window)
    itl: list[tuple[float, float]] = field(default_factory=list)  # (s per token, tokens) per batch (window)
    ttft_s: list[float] = field(default_factory=list)
    window_tokens: int = 0
    window_rounds: int = 0
    window_drafted: int = 0  # nodes sent in the window's rounds
    window_depth: int = 0  # their trees' depths, summed
    open_refused_idle: int = 0
    last_token_at: float = 0.0
    shed_reasons: dict[str, int] = field(default_factory=dict)
    retry_after_s: dict[str, list[float]] = field(default_factory=dict)  # each 429's Retry-After by reason (window)
    # user-seconds spent waiting out a Retry-After inside the window, by the request it answered ("open":
    # holding no session, "verify" holding one), as loadtests.report.waits counts them
    waiting_s: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)  # how each generation ended
    max_gap_s: float = 0.0  # the longest wait of a running session between two deliveries

    def ended(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def refused(self, e: SpecError, in_window: bool) -> None:
        reason = str(getattr(e, "reason", None) or e.code)
        self.shed_reasons[reason] = self.shed_reasons.get(reason, 0) + 1
        if in_window and e.status == 429:
            self.retry_after_s.setdefault(reason, []).append(retry_after_header(e))

    def waited(self, kind: str, start: float, seconds: float, window: tuple[float, float]) -> None:
        self.waiting_s[kind] = self.waiting_s.get(kind, 0.0) + seconds_inside(start, seconds, window)


def retry_after_header(e: SpecError) -> float:
    """The Retry-After a refusal's header carries (:attr:`Overloaded.retry_after_header`); 1 s without one."""
    return float(e.retry_after_header) if isinstance(e, Overloaded) else 1.0


def confidences(parents: list[int], model: AcceptanceModel) -> list[int]:
    """The agent's confidence byte of each node (``edge_agent`` sends them; the server truncates trees
    by them): its path's draft log-probability, a calibrated draft's share for each node by its rank
    among its parent's children: the first guess ``alpha``, the second ``(1 - alpha) * sibling_alpha``,
    each later one ``(1 - sibling_alpha)`` of the one before."""
    a, b = model.alpha, model.sibling_alpha
    rank: dict[int, int] = {}
    logp: list[float] = []
    for p in parents:
        r = rank[p] = rank.get(p, -1) + 1
        share = a if r == 0 else (1 - a) * b * (1 - b) ** (r - 1)
        logp.append((logp[p] if p >= 0 else 0.0) + math.log(max(share, 1e-12)))
    return [encode_confidence(x) for x in logp]


class DraftDevices:
    """Where draft forwards run: ``workers`` shared FIFO workers, or none shared (each user its own)."""

    def __init__(self, workers: int | None):
        self.sem = asyncio.Semaphore(workers) if workers else None

    async def draft(self, seconds: float) -> None:
        if self.sem is None:
            await clock.sleep(seconds)
            return
        async with self.sem:
            await clock.sleep(seconds)


class EdgeUser:
    """One simulated edge agent of ``system`` (:class:`sim.system.System`)."""

    def __init__(self, system, index: int, rng: random.Random, spawn: bool = True):
        """``spawn``: start at the workload's spawn rate (else at once: a burst)."""
        w = system.workload
        self.sys, self.i, self.rng, self.w, self.spawn = system, index, rng, w, spawn
        self.vanished = False  # set by a vanish fault: it drops its session unclosed and stops
        self.retry_after = 1.0  # the Retry-After of the last shed answer
        self.held_s = 0.0  # the router's time of the last verify round it answered
        names = sorted(w.tenants)
        name = rng.choices(names, weights=[w.tenants[n] for n in names])[0]
        by_name = system.router.tenants.by_name
        self.tenant = by_name.get(name) or next(iter(by_name.values()))
        devices = sorted(w.devices)
        self.draft_ms = w.device_ms()[rng.choices(devices, weights=[w.devices[d] for d in devices])[0]]
        spread = math.exp(rng.gauss(0.0, w.network.rtt_sigma)) if w.network.rtt_sigma else 1.0
        self.rtt_s = w.network.rtt_ms / 1000.0 * spread
        self.model = AcceptanceModel(w.acceptance.alpha, w.acceptance.sibling_alpha)
        self.agent = w.client == "edge_agent" and w.mode == "edge"  # else a Locust user, or a server_ar stream
        self.telemetry = Telemetry()  # the agent's, kept across its generations
        self.policy = DepthPolicy(w.depth_policy, AGENT.depth, AGENT.max_depth)

    def _jitter(self, x: float) -> float:
        j = self.w.network.jitter
        return x * self.rng.uniform(1 - j, 1 + j)

    def _rtt(self, share: float = 1.0) -> float:
        """``share`` of this user's round trip now (RTT spikes included), jittered."""
        return self._jitter(self.rtt_s * self.sys.rtt_factor * share)

    def _reported(self) -> dict:
        """What the user's opens and frames report of itself: the agent its telemetry; a Locust user
        (or a server_ar stream) its configured draft ms and RTT."""
        if self.agent:
            return {"draft_ms": self.telemetry.draft_ms.get(0.0), "rtt_ms": self.telemetry.rtt_ms.get(0.0)}
        return {"draft_ms": self.draft_ms, "rtt_ms": self.rtt_s * 1e3}

    async def run(self, end: float) -> None:
        w = self.w
        if w.spawn_rate and self.spawn:
            await clock.sleep(self.i / w.spawn_rate)
        done = 0
        while clock.monotonic() < end and not self.vanished and (w.generations_per_user is None
                                                                  or done < w.generations_per_user):
            await self.generation(end, done)
            done += 1
            await clock.sleep(self.rng.uniform(*w.think_s))

    async def generation(self, end: float, g: int = 0) -> None:
        """This user's ``g``-th generation."""
        w, c, rng = self.w, self.sys.counters, self.rng
        prompt = [rng.randrange(3, SIM_VOCAB) for _ in range(w.prompt_length(self.i, g, rng))]
        truth = continuation(prompt, w.max_tokens)
        c.generations += 1
        t_open = clock.monotonic()
        if self.agent and self.telemetry.rtt_ms.value is None:  # the agent's first generation pings first
            rtt = self._rtt()
            await clock.sleep(rtt)
            self.telemetry.observe_rtt(rtt)
        d = await self.open(prompt, [], end)
        if d is None:
            c.ended("vanished" if self.vanished else "cut" if clock.monotonic() >= end else "refused")
            return
        arrivals: list[tuple[float, int]] = []
        out = [d["first_token"]] if d["first_token"] is not None else []
        if out:
            arrivals.append((clock.monotonic(), 1))
            if w.generations_per_user is not None or t_open >= w.warmup_s:  # steady state, like the rest
                c.ttft_s.append(clock.monotonic() - t_open)
        sid, prefix_len, finished = d["session_id"], d["prefix_len"], d["finished"]
        hints = (d["depth_hint"], d["budget_hint"])
        ready: asyncio.Task | None = None  # the proactive draft of the next tree
        edge = w.mode == "edge"
        rounds = 0  # this generation's verified rounds, as the agent counts them
        while not finished and clock.monotonic() < end:
            if self.vanished:  # gone without a word: its session is the server's to time out
                c.ended("vanished")
                self._gaps(arrivals)
                return
            tokens, parents, depth = [], [], 0
            if edge:
                if self.agent and rounds and rounds % AGENT.ping_every == 0:  # the agent's ping beside its rounds
                    self.telemetry.observe_rtt(self._rtt())
                nodes, depth = self._tree_shape(hints, rounds, w.max_tokens - len(out))
                if depth:
                    tokens, parents, _ = synthetic_tree(truth[len(out):], self.model, depth, nodes, SIM_VOCAB, rng)
                    await (ready or self._draft(depth))
                ready = None
                conf = confidences(parents, self.model) if self.agent and tokens else None
                frame = VerifyFrame(prefix_len, tokens, parents, depth=depth, ahead=w.run_ahead, conf=conf,
                                    **self._reported()).encode()
                t_send = clock.monotonic()
                await clock.sleep(self._rtt(0.5))
                if w.proactive and depth:  # the next tree, drafted while this one is verified
                    ready = asyncio.ensure_future(self._draft(depth))
            else:
                frame = VerifyFrame(prefix_len, [], []).encode()
            status, reply, took = await self.verify(sid, frame)
            if edge:
                await clock.sleep(self._rtt(0.5))
            self.sys.trace.add(round(clock.monotonic(), 9), self.i, "verify", status, round(took, 9))
            if status == 200:
                new = reply.tokens(tokens)
                if new != truth[len(out):len(out) + len(new)]:
                    c.diverged += 1
                out.extend(new)
                c.rounds += 1
                rounds += 1
                if edge and not reply.ahead:  # a run-ahead round's time is several forwards: the agent skips it
                    verified = len(tokens) if reply.verified is None else reply.verified
                    self.telemetry.observe_round(depth, len(reply.accepted), verified,
                                                 (clock.monotonic() - t_send) * 1e3)
                c.tokens += len(new)
                arrivals.append((clock.monotonic(), len(new)))
                c.last_token_at = clock.monotonic()
                if clock.monotonic() >= w.warmup_s:
                    c.round_s.append(took)
                    c.outside_s.append(took - self.held_s)
                    c.window_rounds += 1
                    c.window_tokens += len(new)
                    c.window_drafted += len(tokens)
                    c.window_depth += depth
                if ready is not None and len(reply.accepted) < depth:  # the proactive tree assumed all accepted
                    await ready
                    ready = None
                prefix_len, finished = reply.prefix_len, reply.finished
                hints = (reply.depth_hint or hints[0], reply.budget_hint or hints[1])
                continue
            if ready is not None:
                await ready
                ready = None
            if status in (429, 503):
                c.shed += 1
                await self._wait_out("verify")
            elif status in (404, 410):
                c.reopens += 1
                d = await self.open(prompt, out, end)
                if d is None:
                    c.ended("vanished" if self.vanished else "cut" if clock.monotonic() >= end else "refused")
                    self._gaps(arrivals)
                    return
                sid, prefix_len, finished = d["session_id"], d["prefix_len"], d["finished"]
                if d["first_token"] is not None:
                    out.append(d["first_token"])
                    arrivals.append((clock.monotonic(), 1))
            else:
                c.errors += 1
                c.ended("error")
                self._gaps(arrivals)
                return
        if ready is not None:
            await ready
        c.itl.extend(s for s in _itl(arrivals) if s[0] >= 0)
        self._gaps(arrivals)
        c.ended(("finished" if len(out) == w.max_tokens else "finished_short") if finished else "cut")
        if not (finished and d.get("close_on_finish")):
            try:
                await self.sys.router.close(self.tenant, sid)
            except SpecError:
                pass

    def _tree_shape(self, hints: tuple[int, int], rounds: int, remaining: int) -> tuple[int, int]:
        """(nodes, depth) of the next tree, within the server's limits. The agent's tree rounds: its
        tree (its budget, or the workload's ``nodes``: what its builder makes) under the server's
        budget hint (0: no tree, the server decoding ahead), the workload's depth or its policy's
        under the server's depth hint, at most a level short of the tokens left. A Locust user: the
        workload's nodes and depth, else the server's hints."""
        limits, w = self.sys.app.verifier, self.w
        if self.agent:  # what its tree builder makes (its budget, or the workload's nodes) under the hint
            nodes = min(w.nodes if w.nodes is not None else w.budget, hints[1])
        else:  # loadtests/locustfile.py: a "no tree" hint still gets one node
            nodes = w.nodes if w.nodes is not None else max(1, hints[1])
        nodes = min(nodes, limits.max_tree_nodes)
        if w.depth:
            depth = w.depth
        elif self.agent:
            per_level = max(1.0, min(max(nodes, 1) / max(self.policy.depth, 1), AGENT.max_expand * AGENT.topk))
            depth = self.policy.choose(self.telemetry, hints[0], per_level, rounds)
        else:
            depth = max(1, hints[0])
        left = remaining - 1 if self.agent else depth
        return nodes, max(0, min(depth, nodes, left, limits.max_tree_depth))

    def _draft(self, depth: int):
        """The draft forwards of a ``depth``-level tree on the user's device (awaitable); the agent
        times each."""
        seconds = self._jitter(depth * self.draft_ms / 1000.0)
        for _ in range(depth):
            self.telemetry.observe_draft(seconds / depth)
        return self.sys.devices.draft(seconds)

    def _backoff_s(self) -> float:
        """The wait before a shed request's retry: its Retry-After as the header carries it
        (:func:`retry_after_header`), at most 30 s, times U(0.5, 1.5), as the edge agent and the load
        test's users wait."""
        return min(self.retry_after, MAX_RETRY_AFTER_S) * self.rng.uniform(0.5, 1.5)

    async def _wait_out(self, kind: str) -> None:
        """Waits out the last shed ``kind`` request's Retry-After (:meth:`_backoff_s`), counted."""
        seconds = self._backoff_s()
        self.sys.counters.waited(kind, clock.monotonic(), seconds, (self.w.warmup_s, self.w.duration_s))
        await clock.sleep(seconds)

    def _refused(self, e: SpecError) -> None:
        self.sys.counters.refused(e, clock.monotonic() >= self.w.warmup_s)
        self.retry_after = retry_after_header(e)

    def _gaps(self, arrivals: list[tuple[float, int]]) -> None:
        c = self.sys.counters
        for (t0, _), (t1, _) in zip(arrivals, arrivals[1:]):
            c.max_gap_s = max(c.max_gap_s, t1 - t0)

    async def open(self, prompt: list[int], generated: list[int], end: float) -> dict | None:
        sys = self.sys
        client = self._reported()
        if self.agent:  # the agent's open promises a run-ahead first request (edge_agent.link)
            client["run_ahead"] = self.w.run_ahead
        body = {"prompt_ids": prompt, "generated_ids": generated, "sampling": {"max_tokens": self.w.max_tokens},
                "client": client, "close_on_finish": True}
        while clock.monotonic() < end and not self.vanished:
            await clock.sleep(self._rtt(0.5))
            await sys.client_work(reply=False)
            t0 = clock.monotonic()
            idle = sys.fleet.idle()
            try:
                await sys.router_work()  # the router's loop reaches the request: its fast path, then the rest
                if (shed := sys.fast_shed("POST", "/v1/sessions", self.tenant)) is not None:
                    raise shed
                d, status = await sys.router.open(self.tenant, body, received_at=clock.perf_counter()), 200
            except SpecError as e:
                d, status = None, e.status
                self._refused(e)
                if status == 429 and idle and str(getattr(e, "reason", "")).startswith("open_deadline"):
                    sys.counters.open_refused_idle += 1
            await sys.client_work(reply=True)
            await clock.sleep(self._rtt(0.5))
            sys.trace.add(round(clock.monotonic(), 9), self.i, "open", status, round(clock.monotonic() - t0, 9))
            if status == 200:
                return d
            if status not in (429, 503):
                sys.counters.errors += 1
                return None
            sys.counters.shed += 1
            await self._wait_out("open")
        return None

    async def verify(self, sid: str, frame: bytes) -> tuple[int, ReplyFrame | None, float]:
        """One verify round through the router: (status, reply, seconds as a client times it, its send
        and its read of the reply included)."""
        t0 = clock.monotonic()
        await self.sys.client_work(reply=False)
        try:
            await self.sys.router_work()
            if (shed := self.sys.fast_shed("POST", f"/v1/sessions/{sid}/verify", self.tenant)) is not None:
                raise shed
            held = clock.monotonic()
            payload = await self.sys.router.verify(self.tenant, sid, frame)
            self.held_s = clock.monotonic() - held  # the router's time of it, its reply's Server-Timing
            await self.sys.client_work(reply=True)
            return 200, ReplyFrame.decode(payload), clock.monotonic() - t0
        except SpecError as e:
            self._refused(e)
            await self.sys.client_work(reply=True)
            return e.status, None, clock.monotonic() - t0


def _itl(arrivals: list[tuple[float, int]]) -> list[tuple[float, float]]:
    from benchmarks.metrics import itl_samples  # the benchmarks' own definition of an ITL sample

    return itl_samples(arrivals)
