"""Verifier replica: the target model, the engine, and a continuous batching loop.

Thin Serve adapter over :class:`specdec.engine.VerifierEngine`. Requests of
many sessions queue here while their edges draft (SpecEdge §4.3); a loop takes a batch
(weighted-fair across tenants, :mod:`deploy.verifier.scheduler`), runs ONE target
forward in a worker thread, and answers each request with its reply frame and pacing
hints (:mod:`deploy.verifier.pacing`). New sessions are prefilled in token-budgeted chunks
that ride along in the verify forwards: a chunk is sized from measured costs to add at most
``verifier.prefill_share`` of a verify forward's time per session waiting to be prefilled (at most
``verifier.prefill_chunk_tokens``), so a long prompt never stalls other sessions; when no
session is mid-round, a prefill forward takes up to ``verifier.max_batch_tokens``. Every
engine call runs on the one worker thread, so a close never races a forward. Sessions live
here (KV cache); the router pins
every request of a session to this replica (:mod:`deploy.router.affinity`).
KV memory is bounded: least-recently-used sessions are evicted, idle ones time out;
both answer ``410 session_evicted`` so the edge re-opens from its own token history.

Methods return ``(status, payload)`` rather than raising, so errors cross the Ray
boundary as plain data.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from ray import serve

from deploy import gc_policy
from deploy.config import AppConfig, versions_update
from specdec.errors import (InvalidRequest, ModelNotFound, PrefixMismatch, SessionEvicted, SessionNotFound,
                           SpecError, TokenizerMismatch, VersionUnavailable)
from deploy.metrics import RoundStats, VerifierMetrics
from specdec.protocol import ReplyFrame, VerifyFrame
from specdec.engine import ChainVerifyRequest, ForwardStats, OpenRequest, OpenResult, VerifyRequest
from deploy.verifier.batch_fill import ArrivalModel, fill_wait
from deploy.verifier.early_stream import EarlyStreams
from deploy.verifier.eviction import Limits, SessionUse, choose_victims
from deploy.verifier.kv_sizing import Sizing
from deploy.verifier.startup import start_target
from deploy.verifier.versions import TargetVersions
from specdec.model.loading import tokenizer_fingerprint
from specdec.model.native import PAGE_SIZE
from deploy.verifier.pacing import Pacer
from deploy.verifier.run_ahead import RunAhead
from specdec.sampling import SamplingParams
from deploy.verifier.scheduler import FairScheduler, Pending
from specdec.tree import DraftTree
from specdec.truncation import GainCalibration, choose_prefixes, node_gains

log = logging.getLogger("ray.serve")

MAX_REMEMBERED_EVICTIONS = 100_000
MIN_PREFILL_CHUNK = 4  # prompt tokens per chunk riding along a verify forward, at least


@dataclass
class EdgeClient:
    """What a session's edge tells the replica: its draft time and RTT (SpecEdge §4.3 depth
    pacing) and, in ``ahead``, the tokens a no-tree request brings back (run-ahead: the limit
    and the bonus; else 1), which the budget choice weighs (:mod:`deploy.verifier.pacing`)."""

    draft_ms: float = 0.0
    rtt_ms: float = 0.0
    ahead: int = 1
    run_from_open: bool = False  # the open asked for run-ahead from its first token (ClientInfo.run_ahead)
    draft: str | None = None  # its draft class (ClientInfo.draft): whose acceptance estimates pace it
    close_on_finish: bool = False  # the open asked the replica to close it with its finishing reply
    logprobs: bool = False  # its replies carry the target's log-probs: no run-ahead (R_LOGPROBS)


@dataclass
class QueuedRound:
    """A verify round waiting for the engine (a scheduler :class:`Pending`'s payload)."""

    req: VerifyRequest | ChainVerifyRequest
    fut: asyncio.Future | None  # the request it answers; None for a run-ahead step (its run's)
    gains: list[float]  # per-node draft gains, for batch-time truncation ([] when off)
    run: RunAhead | None = None  # the run-ahead this round belongs to

    @property
    def answers(self) -> asyncio.Future | None:
        """The request this round answers: a run-ahead step's is its run's (None while detached)."""
        return self.run.fut if self.run is not None else self.fut


def _error(e: SpecError) -> tuple[int, dict]:
    return e.status, e.to_dict()


def _draft_class(name) -> str | None:
    """An open's ``client.draft`` as a key: a string of at most 128 characters, else none."""
    return name if isinstance(name, str) and 0 < len(name) <= 128 else None


def _remember(book: OrderedDict, sid: str, value) -> None:
    """Record a gone session (evicted, or closed as it finished); past ``MAX_REMEMBERED_EVICTIONS``
    the oldest record is forgotten (its requests then answer 404, and the edge re-opens as for 410)."""
    book[sid] = value
    while len(book) > MAX_REMEMBERED_EVICTIONS:
        book.popitem(last=False)


def _ema(avg: float, x: float, weight: float) -> float:
    """Exponential moving average; the first observation (avg == 0) starts it."""
    return x if not avg else (1 - weight) * avg + weight * x


def _internal(e: Exception) -> tuple[int, dict]:
    return 500, {"error": {"code": "internal", "message": str(e)}}


def _answer(fut: asyncio.Future | None, result) -> None:
    """Answer a request unless its client has gone (a cancelled future) or there is none (a
    detached run-ahead step)."""
    if fut is not None and not fut.done():
        fut.set_result(result)


def _answer_each(items, reply) -> None:
    """Answer each ``(future, item)`` with ``reply(item)``, independently: a reply that
    raises answers its own request 500 and never touches the others (issue 14). ``None``
    from ``reply``: not answered yet (a run-ahead request went back into the queue)."""
    for fut, item in items:
        try:
            result = reply(item)
        except Exception as e:
            log.exception("answering a request failed")
            result = _internal(e)
        if result is not None:
            _answer(fut, result)


class VerifierCore:
    """Everything of the replica but Serve: usable in-process (tests, local mode)."""

    def __init__(self, config: AppConfig, replica_tag: str = "local", runner=None, loaded=None):
        self.cfg = config
        vc = config.verifier
        if vc.torch_threads:
            torch.set_num_threads(vc.torch_threads)
        t = config.target
        self.tag = replica_tag
        started = start_target(config, self._on_forward, runner, loaded)  # KV pool sized from memory
        self.loaded, self.engine, self.kv_plan = started.loaded, started.engine, started.kv_plan
        # exit heads: early results mid-forward for edges that ask (deploy/verifier/early_stream.py)
        self.early = EarlyStreams.attach(self.engine, vc.early_exit, self.loaded.model)
        p = config.pacing
        budgets = tuple(b for b in p.tree_budgets if b <= vc.max_tree_nodes) or (vc.max_tree_nodes,)
        self.pacer = Pacer(p.min_depth, min(p.max_depth, vc.max_tree_depth), p.default_depth, budgets,
                           min(p.default_tree_budget, vc.max_tree_nodes), p.ema,
                           round_overhead_s=p.round_overhead_ms / 1000.0, tree_margin=p.tree_margin,
                           fill=vc.batch_fill)
        tenants = config.router.load_tenants()  # reads router.tenants_file, once
        self.sched = FairScheduler(weights={tn.name: tn.weight for tn in tenants})
        self._limits = Limits(self.kv_plan.budget_tokens, vc.max_sessions,
                              quotas={tn.name: tn.kv_quota_tokens for tn in tenants if tn.kv_quota_tokens},
                              weights={tn.name: tn.weight for tn in tenants})
        self.metrics = VerifierMetrics.create([tn.name for tn in tenants])
        self.owner: dict[str, str] = {}  # session id -> tenant
        self.client: dict[str, EdgeClient] = {}  # session id -> what its edge reported
        self.evicted: OrderedDict[str, str] = OrderedDict()  # session id -> reason
        self.closed_finished: OrderedDict[str, None] = OrderedDict()  # closed with their last reply (close_on_finish)
        self.forwards: list[ForwardStats] = []  # recent forwards (bounded), for tests and metrics
        # recent verify rounds: (arrival, seconds from arrival to reply), monotonic clock
        self.round_latencies: deque[tuple[float, float]] = deque(maxlen=8192)
        self.busy_seconds = 0.0
        self.busy_cpu_seconds = {"prefill": 0.0, "verify": 0.0}  # the forwards' own CPU time, by kind
        self.verify_totals = [0, 0, 0]  # verify forwards, sessions and rows in them (monotonic)
        self.prefill_tokens_total = 0  # prompt tokens computed: prefill forwards and chunks riding verify forwards
        self.request_totals = [0, 0.0]  # verify requests answered, seconds they spent in this replica
        self.arrivals = ArrivalModel()  # when each session's next round is due (batch filling)
        self.fill_waits = 0  # forwards held for sessions due back
        self.tokens_emitted = 0  # verified tokens returned to clients (first tokens included)
        self.started = time.monotonic()
        self.fingerprint = tokenizer_fingerprint(self.loaded.tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._opens: list[tuple[OpenRequest, str, asyncio.Future]] = []  # not yet handed to the engine
        self._prefilling: dict[str, tuple[str, asyncio.Future]] = {}  # sid -> (tenant, future)
        self._detached: dict[str, RunAhead] = {}  # sid -> its run-ahead between a reply and the next request
        # how the edge's next request found its session's detached run: still decoding (no forward missed),
        # full (the session sat out the forwards since: run_ahead_tokens too small for the round trip),
        # or stopped otherwise (finished, or trees pay again)
        self.takeovers = {"running": 0, "full": 0, "stopped": 0}
        self._verify_s = 0.0  # EMA of a verify forward's seconds
        self._load_peak = (0, 0.0)  # (most sessions open lately, when): the load the pacer weighs
        self._last_verify = 0.0  # when the last verify batch ran (monotonic)
        self._prefill_token_s = 0.0  # EMA of the seconds a prompt token adds to a forward
        self.calibration = GainCalibration()  # draft path probability -> observed acceptance
        # LoRA target versions (FlexSpec): multiplexed adapters, per-version pacing (deploy/verifier/versions.py)
        self.versions = TargetVersions(self.engine, self.loaded.name, t, p, self.pacer)
        self.versions_error: str | None = None  # why the last target-versions update was refused
        self._versions_configured = False  # a reconfigure took effect (the first one runs at start)

    # -- info ---------------------------------------------------------------------
    def model_info(self) -> dict:
        vc = self.cfg.verifier
        return {"model": self.loaded.name, "vocab_size": self.loaded.vocab_size,
                "eos_token_ids": list(self.loaded.eos_token_ids), "tokenizer_fingerprint": self.fingerprint,
                "max_tree_nodes": vc.max_tree_nodes, "max_tree_depth": vc.max_tree_depth,
                "max_model_len": self.engine.max_model_len, **self.early.info()}

    def stats(self) -> dict:
        a, b, knee = self.pacer.cost.coefficients()
        verifies = [f for f in self.forwards if f.kind != "prefill"]
        return {"replica": self.tag, "sessions": len(self.engine.sessions), "kv_tokens": self.engine.kv_tokens(),
                "kv_used_tokens": self.engine.kv_used_tokens(), **self.kv_plan.stats(),
                "forwards": len(self.forwards), "verify_forwards": len(verifies),
                "tokens_emitted": self.tokens_emitted,
                "pending": self.pending(), "busy_seconds": self.busy_seconds,
                "busy_cpu_seconds": dict(self.busy_cpu_seconds),
                "uptime_seconds": time.monotonic() - self.started, "forward_cost_a": a, "forward_cost_b": b,
                "forward_cost_knee": knee,
                "forward_cost_points": [[x, t, n] for x, t, n in sorted(self.pacer.cost.points())],
                "pacing": self.pacer.state(),
                "pacing_classes": self.versions.states(),
                "batch_sizes": [f.sessions for f in self.forwards if f.kind == "verify"],
                "verify_forwards_total": self.verify_totals[0], "verify_sessions_total": self.verify_totals[1],
                "verify_rows_total": self.verify_totals[2], "prefill_tokens_total": self.prefill_tokens_total,
                "verify_requests_total": self.request_totals[0], "verify_request_seconds_total": self.request_totals[1],
                "run_ahead_takeovers": dict(self.takeovers),
                "prefix_cache": self.engine.prefix_cache_stats(),
                "evictions": len(self.evicted), "versions": self.versions.registry.served(),
                "versions_unavailable": dict(self.versions.registry.unavailable),
                "versions_error": self.versions_error}

    def pending(self) -> int:
        """Requests waiting for the engine: verify rounds and opens (queued or prefilling)."""
        return len(self.sched) + len(self._opens) + len(self._prefilling)

    def _on_forward(self, st: ForwardStats) -> None:
        self.busy_seconds += st.seconds
        self.busy_cpu_seconds["prefill" if st.kind == "prefill" else "verify"] += st.cpu_seconds
        self.prefill_tokens_total += st.tokens if st.kind == "prefill" else st.prefill_tokens
        if st.kind == "prefill":
            self._prefill_token_s = _ema(self._prefill_token_s, st.seconds / max(st.tokens, 1), 0.3)
        elif st.prefill_tokens and self._verify_s:  # what the chunk added to a verify forward of its rows
            extra = max(st.seconds - self._verify_forward_s(st.tokens - st.prefill_tokens), 0.0) / st.prefill_tokens
            self._prefill_token_s = _ema(self._prefill_token_s, extra, 0.3)
        elif not st.prefill_tokens:
            self._verify_s = _ema(self._verify_s, st.seconds, 0.2)
        if st.kind != "prefill":
            self.pacer.observe_forward(st.tokens, st.seconds)
            t = self.verify_totals
            t[0], t[1], t[2] = t[0] + 1, t[1] + st.sessions, t[2] + st.tokens
        self.forwards.append(st)
        self.metrics.on_forward(st)
        if len(self.forwards) > 4096:
            del self.forwards[:2048]

    # -- session bookkeeping --------------------------------------------------------
    def _check_owner(self, sid: str, tenant: str) -> None:
        owner = self.owner.get(sid)
        if owner is None:
            if self.evicted.get(sid, "").startswith("model_removed"):
                raise ModelNotFound(f"session {sid!r}: its target version was removed from this server "
                                    f"({self.evicted[sid]}); open a session of a served version")
            if self.evicted.get(sid, "").startswith("model_unavailable"):
                raise VersionUnavailable(f"session {sid!r}: its target version could not be loaded "
                                         f"({self.evicted[sid]})")
            if sid in self.closed_finished:
                raise SessionEvicted(f"session {sid!r} finished and was closed with its last reply "
                                     f"(close_on_finish); open a new session")
            if sid in self.evicted:
                raise SessionEvicted(f"session {sid!r} was evicted ({self.evicted[sid]}); re-open it with its history")
            raise SessionNotFound(f"unknown session {sid!r} (it may have been lost in a restart); re-open it")
        if owner != tenant:  # do not reveal that another tenant's session exists
            raise SessionNotFound(f"unknown session {sid!r}")

    async def _evict(self, sid: str, reason: str) -> None:
        # on the worker thread, like every engine call: never beside a forward or a close
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.close, sid)
        self._forget(sid, reason)

    def _forget(self, sid: str, reason: str) -> None:
        """A session the engine no longer holds: its requests answer 410 from now on."""
        self._drop(sid)
        _remember(self.evicted, sid, reason)
        self.metrics.on_evict(sid, reason)

    def _drop(self, sid: str) -> None:
        """The replica's own records of a session (the engine's are dropped on the worker thread)."""
        self._detached.pop(sid, None)
        self.owner.pop(sid, None)
        self.client.pop(sid, None)
        self.arrivals.forget(sid)

    def _reply_sent(self, sid: str, now: float, back: bool, finished: bool) -> None:
        """A reply to the session's edge goes out: the arrival model expects the edge ``back``
        (else forgets it), and a finished ``close_on_finish`` session is closed with it."""
        if back:
            self.arrivals.replied(sid, now)
        else:
            self.arrivals.forget(sid)
        self._close_if_finished(sid, finished)

    def _close_if_finished(self, sid: str, finished: bool) -> None:
        """A reply that says the session finished is being sent: a session opened with
        ``close_on_finish`` is closed with it, so its client spends neither a round trip nor a
        request's server CPU on a close before its next open. Its requests answer 410 from now
        on; a close request answers 200. A detached run's tokens are never in such a reply
        before the edge's request takes them, so nothing generated is dropped."""
        edge = self.client.get(sid)
        if not finished or edge is None or not edge.close_on_finish:
            return
        self._drop(sid)
        _remember(self.closed_finished, sid, None)
        # on the worker thread, like every engine call: after any forward already queued there
        asyncio.get_running_loop().run_in_executor(self._executor, self.engine.close, sid)

    def _session_uses(self) -> list[SessionUse]:
        """Each live session's KV (its committed tokens in whole pages), tenant and last use."""
        return [SessionUse(sid, self.owner.get(sid, ""), -(-len(s.prefix) // PAGE_SIZE) * PAGE_SIZE, s.last_used)
                for sid, s in self.engine.sessions.items()]

    async def _enforce_budgets(self, protect: set[str]) -> None:
        """Evict above a tenant's KV quota, the replica's KV budget or its session limit
        (:mod:`deploy.verifier.eviction`)."""
        for sid in choose_victims(self._session_uses(), self._limits, frozenset(protect)):
            await self._evict(sid, "kv_budget")

    async def sweep_idle(self) -> int:
        now = time.monotonic()
        pending = self.sched.pending_sessions()
        idle = [sid for sid, s in self.engine.sessions.items()
                if now - s.last_used > self.cfg.verifier.idle_timeout_s and sid not in pending]
        for sid in idle:
            await self._evict(sid, "idle_timeout")
        self.arrivals.prune(self.engine.sessions)
        return len(idle)

    # -- requests ---------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop())

    async def open_session(self, tenant: str, body: dict) -> tuple[int, dict]:
        try:
            prompt = [int(t) for t in body["prompt_ids"]]
            generated = tuple(int(t) for t in body.get("generated_ids") or ())
            if len(prompt) + len(generated) > self.cfg.verifier.max_prompt_tokens:
                raise InvalidRequest(f"prompt + history exceed {self.cfg.verifier.max_prompt_tokens} tokens")
            params = SamplingParams.from_dict(body.get("sampling")).validate(self.loaded.vocab_size)
            fp = (body.get("client") or {}).get("tokenizer_fingerprint")
            if fp and fp != self.fingerprint:
                raise TokenizerMismatch(f"tokenizer mismatch: the edge's tokenizer {fp} differs from the "
                                        f"target's {self.fingerprint}")
            version = self.versions.resolve(body.get("model"))
        except SpecError as e:
            return _error(e)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            return _error(InvalidRequest(f"malformed open request: {e}"))
        sid = f"{self.tag}.{uuid.uuid4().hex}"
        fut = asyncio.get_running_loop().create_future()
        self._ensure_loop()
        req = OpenRequest(sid, prompt, params, generated, adapter=version, cache_salt=tenant)  # shares within a tenant
        self._opens.append((req, tenant, fut))
        self.metrics.on_arrival(sid)
        client = body.get("client") or {}
        # until its first request says otherwise, an edge is taken to accept run-ahead replies (the
        # agent's default): the open's hint then weighs a tree against them, as later hints will
        self.client[sid] = EdgeClient(float(client.get("draft_ms") or 0.0), float(client.get("rtt_ms") or 0.0),
                                      self._ahead_tokens(params.logprobs is None),
                                      bool(client.get("run_ahead")) and params.logprobs is None,
                                      _draft_class(client.get("draft")), bool(body.get("close_on_finish")),
                                      params.logprobs is not None)
        self._wake.set()
        return await fut

    async def verify(self, session_id: str, tenant: str, frame: bytes) -> tuple[int, bytes | dict]:
        try:
            f = VerifyFrame.decode(frame, max_nodes=self.cfg.verifier.max_tree_nodes)
            self._check_owner(session_id, tenant)
            if f.q is None:
                req = VerifyRequest(session_id, DraftTree(tuple(f.tokens), tuple(f.parents)), f.prefix_len,
                                    proposals=f.proposals,  # proposals: tree rejection sampling
                                    early=self.early.accept(f))
            else:
                if any(p != i - 1 for i, p in enumerate(f.parents)):
                    raise InvalidRequest("chain mode: parents must form a chain")
                req = ChainVerifyRequest(session_id, tuple(f.tokens), tuple(f.q), f.prefix_len, f.resampled, f.more)
        except SpecError as e:
            return _error(e)
        edge = self.client.setdefault(session_id, EdgeClient())
        if f.draft_ms or f.rtt_ms:
            edge.draft_ms, edge.rtt_ms = f.draft_ms, f.rtt_ms
        edge.ahead = ahead = self._ahead_tokens(f.ahead and not edge.logprobs)
        self.metrics.on_frame(tenant, f)
        fut = asyncio.get_running_loop().create_future()
        self._ensure_loop()
        gains = (node_gains(f.parents, f.conf) if f.q is None and f.proposals is None
                 and self.cfg.verifier.truncate_trees else [])
        now = time.monotonic()
        self.arrivals.arrived(session_id, now)
        if session_id in self._detached:
            out = await self._take_over(tenant, session_id, f, fut)
        else:
            run = RunAhead(ahead - 1, f.prefix_len, fut, len(f.tokens)) if ahead > 1 else None
            self._enqueue(Pending(tenant, session_id, len(f.tokens) + 1, QueuedRound(req, fut, gains, run), now))
            out = await fut
        self.request_totals[0] += 1
        self.request_totals[1] += time.monotonic() - now  # queue, batch wait, forward(s), reply
        return out

    async def _take_over(self, tenant: str, sid: str, f: VerifyFrame, fut: asyncio.Future):
        """The edge's next request meets its session's detached run (:mod:`deploy.verifier.run_ahead`):
        it takes the run over, and its reply starts with the tokens decoded meanwhile."""
        run = self._detached[sid]
        if not f.ahead or f.prefix_len != run.base_prefix:
            return _error(PrefixMismatch(
                f"request assumes a prefix of {f.prefix_len} tokens; this session ran ahead from "
                f"{run.base_prefix} (F_AHEAD): send F_AHEAD at that prefix, or re-open it",
                server_prefix_len=run.base_prefix))
        del self._detached[sid]
        self.takeovers["running" if run.queued else "full" if run.full else "stopped"] += 1
        run.attach(fut, len(f.tokens))
        if not run.queued:  # it stopped (full, ended, or trees pay again): the reply is ready
            _answer(fut, self._reply_run(tenant, sid, run, *self._hints(sid)))
        return await fut

    async def verify_stream(self, session_id: str, tenant: str, frame: bytes):
        """:meth:`verify` as a stream: the round's early frames (``F_EARLY``) as the forward
        reaches each exit, then ``("final", status, payload)`` (Serve streaming call)."""
        async for item in self.early.stream(session_id, self.verify(session_id, tenant, frame)):
            yield item

    async def close_session(self, session_id: str, tenant: str) -> tuple[int, dict]:
        try:
            self._check_owner(session_id, tenant)
        except SessionEvicted:
            self.evicted.pop(session_id, None)
            self.closed_finished.pop(session_id, None)
            return 200, {"closed": session_id}
        except SpecError as e:
            return _error(e)
        # on the worker thread: never while a forward that holds this session runs
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.close, session_id)
        self._drop(session_id)
        return 200, {"closed": session_id}

    async def update_versions(self, adapters: dict[str, str], max_loaded: int) -> dict:
        """Add, remove or re-point target versions without a restart (on the worker thread,
        between forwards). Sessions of a removed, re-pointed or rewritten version end: their
        requests answer 404 ``model_not_found`` from then on; no other session is touched.
        New versions are validated first: a bad one is listed under ``unavailable``."""
        def apply():
            gone = self.versions.update(adapters, max_loaded)
            return gone, self.engine.drop_versions(gone)

        gone, sids = await asyncio.get_running_loop().run_in_executor(self._executor, apply)
        for sid in sids:
            self.client.pop(sid, None)
            if sid in self._prefilling:
                _answer(self._prefilling.pop(sid)[1], _error(ModelNotFound(
                    f"the target version of this session was removed from this server ({sorted(gone)})")))
            else:
                self._forget(sid, "model_removed")
        if gone:
            log.info("target versions removed or changed: %s (%d sessions closed)", sorted(gone), len(sids))
        return {"versions": self.versions.names(), "removed": sorted(gone), "closed_sessions": len(sids),
                "unavailable": dict(self.versions.registry.unavailable)}

    async def apply_user_config(self, user_config: dict) -> None:
        """The Serve ``user_config`` (``reconfigure``): the target versions (``target.adapters``),
        validated like the app's config (:func:`deploy.config.versions_update`). An invalid
        ``user_config`` fails the replica's start (Serve reports the deployment failed, with
        the reason); on a running replica it is refused, logged and shown in ``/v1/stats``
        (``versions_error``), the served versions unchanged: raising here would make Serve
        stop the replica and every session on it. A version whose adapter fails validation
        is served as unavailable (503 ``model_unavailable``), the others as declared."""
        try:
            target = versions_update(self.cfg, user_config).target
        except ValueError as e:
            if not self._versions_configured:
                raise
            self.versions_error = str(e)
            log.error("target versions update refused, the served versions are unchanged: %s", e)
            return
        await self.update_versions(target.adapters, target.max_loaded_adapters)
        self._versions_configured, self.versions_error = True, None

    # -- the batching loop -------------------------------------------------------------
    def _ahead_tokens(self, asks: bool) -> int:
        """Tokens a no-tree request brings back: with run-ahead (asked for, and on), the limit and
        the bonus; else the bonus alone."""
        limit = self.cfg.verifier.run_ahead_tokens
        return limit + 1 if asks and limit else 1

    def _pacing(self, sid: str) -> tuple[Pacer, int, EdgeClient]:
        """What a session's hints rest on: its version's pacer (its own acceptance, FlexSpec
        §III-C), the sessions sharing the verifier, and what its edge reported."""
        edge = self.client.get(sid) or EdgeClient()
        return self.versions.pacer(sid, edge.draft), self._load_sessions(), edge

    def _load_sessions(self) -> int:
        """Sessions sharing the verifier, as the tree budget weighs them: the most open within
        ``pacing.sessions_hold_s``. When a generation ends its session closes and the edge opens
        the next a round trip later; counted out meanwhile, the sessions left looked alone, and
        a session alone is asked for trees (full run `20261125-074518-full`, RTT 100 ms, 4
        sessions in lockstep: 1.6 tree nodes a round where run-ahead paid)."""
        now, n = time.monotonic(), max(len(self.engine.sessions), 1)
        peak, at = self._load_peak
        if n >= peak or now - at > self.cfg.pacing.sessions_hold_s:
            self._load_peak = (n, now)
            return n
        return peak

    def _hints(self, sid: str) -> tuple[int, int]:
        pacer, n, edge = self._pacing(sid)
        budget = pacer.budget_hint(n, edge.ahead, edge.rtt_ms / 1000.0)
        return pacer.depth_hint(n, budget, edge.draft_ms, edge.rtt_ms), budget

    def _best_budget(self, sid: str) -> int:
        pacer, n, edge = self._pacing(sid)
        return pacer.best_budget(n, edge.ahead, edge.rtt_ms / 1000.0)

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        vc = self.cfg.verifier
        last_sweep = time.monotonic()
        while True:
            if not self._opens and not len(self.sched) and not self._prefilling:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=5.0)
                except asyncio.TimeoutError:
                    pass
            if vc.batch_wait_ms > 0 and self._others_may_join():
                await asyncio.sleep(vc.batch_wait_ms / 1000.0)  # let a few more requests join this forward
            await self._fill_batch()
            if time.monotonic() - last_sweep > min(5.0, vc.idle_timeout_s / 2):
                await self.sweep_idle()
                last_sweep = time.monotonic()
            self.metrics.refresh(self)
            try:
                if self._opens:
                    opens, self._opens = self._opens, []
                    await self._begin_opens(loop, opens)
                batch = self.sched.take(vc.max_batch_sessions, vc.max_batch_tokens)
                if batch:  # a prefill chunk rides along
                    await self._run_verifies(loop, batch)
                    self._last_verify = time.monotonic()
                elif self._prefilling:
                    busy = self._decoding_recently()
                    if busy and await self._request_arrives(max(0.002, 2 * self._verify_s)):
                        continue  # a verify round came back: the next chunk rides along with it
                    # the edges are drafting (or gone): prefill in the gap
                    await self._run_prefill(loop, self._prefill_budget() if busy else vc.max_batch_tokens)
            except Exception as e:  # never let one bad batch kill the loop
                log.exception("verify loop error: %s", e)

    def _decoding_recently(self) -> bool:
        """Whether a prompt waiting with no verify round queued is prefilled in paced chunks (some
        session is decoding and verified a moment ago: its edge is drafting and its next round
        may come back at any time) or at once. With no session left decoding (one user between
        generations, above all: the last one finished and was closed) nobody can come back, and
        paced chunks would only cost whole forwards: seen at 1 session (`benchmarks.run`, RTT
        15 ms), every prompt went in as 4 + 4 tokens, then the rest, each tiny chunk a forward
        that reads every weight and a wait for a round that never came."""
        if time.monotonic() - self._last_verify >= max(0.05, 4 * self._verify_s):
            return False
        return any(not s.finished for s in list(self.engine.sessions.values()))  # a copy: closes run on the worker

    def _others_may_join(self) -> bool:
        """Whether a request not yet queued could still join the next forward: the batch has room
        and some session of this replica has no round queued. With one session (or every session
        waiting) a fixed batch wait is latency with nothing to gain: measured at 1 session, RTT
        15 ms, the embedded target, 2.5 ms of a 14.4 ms replica time per round."""
        queued = len(self.sched.pending_sessions())
        return queued < min(self.cfg.verifier.max_batch_sessions, len(self.engine.sessions))

    async def _fill_batch(self) -> None:
        """Hold the forward for the sessions due back within ``batch_fill`` x its predicted time
        (:mod:`deploy.verifier.batch_fill`); re-decided as each arrives, never past the first deadline."""
        vc = self.cfg.verifier
        if vc.batch_fill <= 0 or self.pacer.cost.count < 3 or not len(self.sched):
            return
        deadline = None
        while True:
            pending = self.sched.pending_sessions()
            rows = self.sched.pending_tokens()
            now = time.monotonic()
            wait = fill_wait(rows, self.arrivals.due(now, pending), rows / max(len(pending), 1),
                             self.pacer.cost.predict, vc.batch_fill, vc.max_batch_sessions, len(pending))
            if deadline is None:
                deadline = now + wait
            wait = min(wait, deadline - now)
            if wait <= 0.0005:
                return
            self.fill_waits += 1
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=wait)
            except asyncio.TimeoutError:
                return

    async def _request_arrives(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a verify request; whether one is queued."""
        if len(self.sched):
            return True
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            pass
        return bool(len(self.sched))

    def _verify_forward_s(self, rows: int) -> float:
        """Predicted seconds of a verify forward of ``rows`` rows: the replica's measured cost
        curve (:class:`deploy.verifier.pacing.PiecewiseCost`) once it has seen a few forwards, the
        EMA of verify forwards before that."""
        cost = self.pacer.cost
        return cost.predict(rows) if cost.count >= 3 else self._verify_s

    def _prefill_budget(self, rows: int | None = None) -> int:
        """Prompt tokens to add to a verify forward of ``rows`` rows (None: a typical one): as many
        as fit in ``prefill_share`` of its time for each session waiting to be prefilled (measured
        costs; the cost per prompt token grows with the prompt's length). One long prompt takes a
        small share, so the sessions decoding barely notice it; a burst of opens takes more, so
        they join the batch together instead of one by one. With a fixed share of 0.2, 32 sessions
        opening at once (RTT 15 ms, one core) joined over ~2 s and the forwards carried 8-10 of
        them instead of ~28 (benchmarks/results/README.md, "Prefill that trickles in").

        Both sides are of the forward at hand: a chunk's cost is what its forward took beyond the
        cost curve's time for its verify rows alone (:meth:`_on_forward`). Measured against one
        EMA of verify forwards instead, the EMA held the small forwards of before the burst (only
        forwards without a chunk move it, and during a burst every forward has one), so a 24-session
        forward's own growth was charged to its chunk: the budget fell to the 4-token floor, and of
        the 10 prompts of a 32-session burst left after the first prefill forward, 6 still waited
        60 forwards later (RTT 15 ms, embedded bf16, one core; now all join within ~25)."""
        vc = self.cfg.verifier
        if not (self._verify_s and self._prefill_token_s):
            return min(vc.prefill_chunk_tokens, 16)
        verify_s = self._verify_s if rows is None else self._verify_forward_s(rows)
        fit = int(vc.prefill_share * max(len(self._prefilling), 1) * verify_s / self._prefill_token_s)
        # a chunk also has a fixed cost (its rows read the prompt's whole KV so far): at least
        # MIN_PREFILL_CHUNK tokens, or tiny chunks would pay it over and over for little progress
        return max(min(MIN_PREFILL_CHUNK, vc.prefill_chunk_tokens), min(vc.prefill_chunk_tokens, fit))

    def _chunk_budget(self, batch: list[Pending]) -> int:
        """Prompt tokens to add to the forward of ``batch``: :meth:`_prefill_budget`, or, when the
        batch is detached run-ahead steps alone (their edges are away: nobody waits on this
        forward), as many as fit before the first edge is due back (:class:`ArrivalModel`; a session
        with no round trip measured yet is not counted), up to ``verifier.max_batch_tokens``.
        Seen before this rule (full run `20261124-224818-full`, 4 sessions, RTT 100 ms): a
        configuration began with 14 forwards of one session, whose run from its open carried the
        other three prompts in paced chunks; in the gap those would have been one prefill forward."""
        rows = sum(p.tokens for p in batch)
        paced = self._prefill_budget(rows)
        if any(p.payload.run is None or p.payload.run.fut is not None for p in batch) or not self._prefill_token_s:
            return paced
        most = self.cfg.verifier.max_batch_tokens
        due = self.arrivals.due(time.monotonic(), set())
        fit = int((due[0] - self._verify_forward_s(rows)) / self._prefill_token_s) if due else most
        return max(paced, min(most, fit))

    async def _begin_opens(self, loop, opens) -> None:
        try:
            errors = await loop.run_in_executor(self._executor, self.engine.begin_open, [o[0] for o in opens])
        except Exception as e:
            log.exception("queueing opens failed")
            errors = [e] * len(opens)
        for (req, tenant, fut), err in zip(opens, errors):
            if err is not None:
                self.client.pop(req.sid, None)
                _answer(fut, _error(err) if isinstance(err, SpecError) else _internal(err))
            else:
                self._prefilling[req.sid] = (tenant, fut)

    async def _run_prefill(self, loop, budget: int) -> None:
        try:
            results = await loop.run_in_executor(self._executor, self.engine.prefill_step, budget)
        except SpecError as e:  # the KV pool is full: the opens the engine dropped fail with a clear error
            results = []
            self._fail_dropped_opens(e)
        except Exception as e:
            log.exception("prefill failed")
            for sid in list(self._prefilling):
                await loop.run_in_executor(self._executor, self.engine.close, sid)
                self.client.pop(sid, None)
                _answer(self._prefilling.pop(sid)[1], _internal(e))
            return
        self._settle_version_failures()
        await self._complete_opens(loop, results)

    def _fail_dropped_opens(self, e: SpecError) -> None:
        """Answer the opens whose prefill the engine gave up (a full KV pool)."""
        for sid in [sid for sid in self._prefilling if sid not in self.engine.prefilling]:
            self.client.pop(sid, None)
            _answer(self._prefilling.pop(sid)[1], _error(e))

    async def _complete_opens(self, loop, results: list[OpenResult]) -> None:
        answers = []
        for res in results:
            tenant, fut = self._prefilling.pop(res.sid)
            if fut.done():  # the client went away while its prompt was prefilled
                await loop.run_in_executor(self._executor, self.engine.close, res.sid)
                self.client.pop(res.sid, None)
                continue
            self.owner[res.sid] = tenant
            answers.append((fut, (tenant, res)))
        if results:  # before answering: an open's reply reports the replica after its evictions
            await self._enforce_budgets(protect={r.sid for r in results})
        _answer_each(answers, self._open_reply)

    def _open_reply(self, item: tuple[str, OpenResult]) -> tuple[int, dict]:
        tenant, res = item
        self.metrics.on_open(tenant, res.sid, res.prefix_len, res.cached_tokens, first_token=res.first_token is not None,
                             finish_reason=res.finish_reason if res.finished else None)
        self.tokens_emitted += res.first_token is not None
        now = time.monotonic()
        if not res.finished:
            self.arrivals.replied(res.sid, now)
        depth, budget = self._hints(res.sid)
        self._run_from_open(tenant, res, budget, now)
        edge = self.client.get(res.sid)
        reply = (200, {
            "session_id": res.sid, "first_token": res.first_token, "prefix_len": res.prefix_len,
            "first_logprob": res.first_logprob.to_dict() if res.first_logprob is not None else None,
            "cached_tokens": res.cached_tokens, "finished": res.finished, "finish_reason": res.finish_reason,
            "depth_hint": depth, "budget_hint": budget, "tokenizer_fingerprint": self.fingerprint,
            "model": self.versions.name_of(res.sid), "close_on_finish": edge is not None and edge.close_on_finish})
        self._close_if_finished(res.sid, res.finished)
        return reply

    def _run_from_open(self, tenant: str, res: OpenResult, budget: int, now: float) -> None:
        """An open whose edge promised an ``F_AHEAD`` first request (``client.run_ahead``) and whose
        hint is 0 decodes on from its first token, detached, while the reply and that request are
        on the wire, as after a run-ahead reply (:meth:`_reply_run`). Without it, a burst of opens
        prefilled together spent the next forwards on the few sessions opened before (measured:
        8 sessions, RTT 15 ms, 4 forwards of 1-2 sessions after the burst's prefill)."""
        edge = self.client.get(res.sid)
        # edge.ahead is 1 with run-ahead off (verifier.run_ahead_tokens 0)
        if budget or res.finished or res.first_token is None or edge is None or not edge.run_from_open \
                or edge.ahead <= 1:
            return
        run = self._detached[res.sid] = RunAhead(edge.ahead - 1, res.prefix_len)  # as verify() builds a run
        self._queue_step(tenant, res.sid, run, now)

    async def _run_verifies(self, loop, batch: list[Pending]) -> None:
        trees = [(p, p.payload.req) for p in batch if isinstance(p.payload.req, VerifyRequest)]
        chains = [(p, p.payload.req) for p in batch if isinstance(p.payload.req, ChainVerifyRequest)]
        self.metrics.on_batch_start(batch)

        prefill = self._chunk_budget(batch) if self._prefilling else 0
        trees = self._truncate(trees, prefill)

        def run():
            out, opened = [], []
            if trees:  # the chunk rides along; the opens it completes wait in engine.take_opened()
                out += list(zip([p for p, _ in trees], self.engine.verify(
                    [r for _, r in trees], prefill, on_early=self.early.sink(loop, [r.sid for _, r in trees if r.early]))))
            if chains:
                out += list(zip([p for p, _ in chains], self.engine.verify_chain([r for _, r in chains])))
                if not trees and prefill:  # chain forwards take no chunk: a prefill step of its own
                    opened = self.engine.prefill_step(prefill)
            return out, self.engine.take_opened() + opened

        try:
            results, opened = await loop.run_in_executor(self._executor, run)
        except SpecError as e:  # a full KV pool or a lost commit: a clear 503 for the batch and its prompts
            for p in batch:
                _answer(p.payload.answers, self._run_so_far(p) or _error(e))
            for sid in getattr(e, "sessions", ()):  # KVStateLost: the engine dropped them
                if sid in self.owner:
                    self._forget(sid, "kv_state_lost")
            self._fail_dropped_opens(e)
            return
        except Exception as e:
            log.exception("verify forward failed")
            for p in batch:
                _answer(p.payload.answers, self._run_so_far(p) or _internal(e))
            return
        self._settle_version_failures()
        # a forward of trees alone: no run-ahead step (an empty tree) in it. A tree round of an edge that
        # takes run-ahead replies (F_AHEAD, the agent's default) carries a run too, so the test is the tree:
        # on `payload.run is None` the default agent's trees were never measured
        if trees and not chains and all(len(r.tree) for _, r in trees):
            self.pacer.observe_tree_batch(self._load_sessions(), len(batch))
        _answer_each([(p.payload.answers, (p, res)) for p, res in results], self._round_reply)
        await self._complete_opens(loop, opened)

    def _settle_version_failures(self) -> None:
        """Sessions the engine closed because their version failed to load: a prefilling open
        answers the error now, a live session answers it from then on (503 ``model_unavailable``)."""
        for sid, e in self.engine.take_version_failures().items():
            self.client.pop(sid, None)
            if sid in self._prefilling:
                _answer(self._prefilling.pop(sid)[1], _error(e))
            elif sid in self.owner:
                self._forget(sid, f"model_unavailable: {e.message}")

    def _truncate(self, trees: list, base_rows: int) -> list:
        """Server-side truncation at batch time (:mod:`specdec.truncation`): each
        tree's request gets the prefix length that maximises expected verified tokens per
        second of this forward, by the measured cost curve and calibrated node gains."""
        if not trees or not self.cfg.verifier.truncate_trees or self.pacer.cost.count < 3:
            return trees
        whole = [(p, r) for p, r in trees if r.proposals is not None]  # sampled trees: never cut by value
        trees = [(p, r) for p, r in trees if r.proposals is None]
        gains = [self.calibration.scale(p.payload.gains) for p, _ in trees]
        take = choose_prefixes(gains, self.pacer.cost.predict, base_rows + sum(len(r.tree) + 1 for _, r in whole))
        return whole + [(p, VerifyRequest(r.sid, r.tree, r.prefix_len, n, early=r.early))
                        for (p, r), n in zip(trees, take)]

    def _queue_step(self, tenant: str, sid: str, run: RunAhead, now: float) -> None:
        """One more run-ahead step: an empty tree at the run's prefix, in the next forward."""
        run.queued = True
        step = VerifyRequest(sid, DraftTree.empty(), run.next_prefix)
        self._enqueue(Pending(tenant, sid, 1, QueuedRound(step, None, [], run), now))

    def _enqueue(self, p: Pending) -> None:
        """Queue a round for the batch loop and wake it. Every round queued wakes the loop, from a
        request's handler or from the loop itself: a run-ahead step queued by the reply to a
        request that took over a full run once waited, with the edge's next request behind it,
        for the loop's 5 s idle timeout."""
        self.sched.add(p)
        if self._wake is not None:
            self._wake.set()

    def _run_so_far(self, p: Pending) -> tuple[int, bytes] | None:
        """A run-ahead step that failed (its session evicted or closed meanwhile, a failed
        forward): the request's reply with the tokens decoded so far, so none is lost; the
        edge's next request meets the failure. None for any other round, or with nothing to send."""
        run = p.payload.run
        if run is None:
            return None
        run.queued = False
        if self._detached.get(p.session_id) is run:
            del self._detached[p.session_id]
        if run.fut is None or run.last is None:
            return None
        return 200, run.frame(*self._hints(p.session_id)).encode()

    def _reply_run(self, tenant: str, sid: str, run: RunAhead, depth: int, budget: int) -> tuple[int, bytes]:
        """A run-ahead request's reply. While the hint stays 0 the session decodes on, detached,
        until the edge's next request takes the run over."""
        now = time.monotonic()
        if budget == 0 and not run.ended and not run.fut.done():
            nxt = self._detached[sid] = RunAhead(run.limit, run.last.prefix_len)
            self._queue_step(tenant, sid, nxt, now)
        self._reply_sent(sid, now, not run.ended, run.last.finished)
        return 200, run.frame(depth, budget).encode()

    def _round_reply(self, item) -> tuple[int, bytes | dict] | None:
        """Bookkeeping and the reply frame of one verified round; None when a run-ahead
        request decodes on (:mod:`deploy.verifier.run_ahead`: it is queued again)."""
        p, res = item
        req, gains, run = p.payload.req, p.payload.gains, p.payload.run
        if isinstance(res, SpecError):
            return self._run_so_far(p) or _error(res)
        tree_mode = isinstance(req, VerifyRequest)
        # chain mode: a rejected round has no bonus; the residual sample it owes arrives (and is
        # emitted) with the next request, and counts there
        rs = RoundStats.of(p.tenant, req, res)
        n_nodes, emitted = rs.draft_tokens, rs.emitted
        if tree_mode and gains:
            self.calibration.observe(sum(gains[:n_nodes]), len(res.accepted))
        refill = not tree_mode and req.more  # more residual candidates: no draft was verified
        if not refill:
            self._pacing(p.session_id)[0].observe_round(n_nodes, emitted)
        self.tokens_emitted += emitted
        now = time.monotonic()
        self.round_latencies.append((p.enqueued_at, now - p.enqueued_at))
        if run is not None:
            run.add(res)
            run.queued = False
            # decoding on needs the best budget to be 0 (a step's hints are 0); only a reply asks the
            # pacer for its hint, so exploration stays one in explore_every replies
            more = run.continues(self._best_budget(p.session_id))
            if more or run.fut is None:
                self.metrics.on_round(p.tenant, p.session_id, req, res, 0, 0, version=self.versions.label(p.session_id))
                if more:
                    self._queue_step(p.tenant, p.session_id, run, now)
                return None  # decoding on, or detached and stopped: its tokens wait for the next request
        depth, budget = self._hints(p.session_id)
        if not refill:
            self.metrics.on_round(p.tenant, p.session_id, req, res, depth, budget,
                                  version=self.versions.label(p.session_id))
        if run is not None:
            return self._reply_run(p.tenant, p.session_id, run, depth, budget)
        if tree_mode:
            frame = ReplyFrame(list(res.accepted), res.bonus, res.prefix_len, res.finished, res.finish_reason,
                               depth, budget, verified=res.verified if res.verified < len(req.tree) else None,
                               logprobs=list(res.logprobs) if res.logprobs is not None else None)
        else:
            frame = ReplyFrame.of_chain(res, depth, budget)
        self._reply_sent(p.session_id, now, not (res.finished or refill), res.finished)
        return 200, frame.encode()


class VerifierReplica(VerifierCore):
    """A Serve replica's :class:`VerifierCore`: the replica tag prefixes session ids. The
    ``Verifier`` deployment (``split`` topology), or built inside the router replica
    (``colocated``, :mod:`deploy.router.in_process`)."""

    def __init__(self, config: dict):
        cfg = AppConfig(**config)
        tag = serve.get_replica_context().replica_id.unique_id
        runner = loaded = None
        vc = cfg.verifier
        if vc.pipeline_parallel_size > 1:  # stages load their own layer slices; the replica holds no weights
            from deploy.verifier.pipeline import build_runner

            runner = build_runner(cfg.target, vc.pipeline_parallel_size, cpus_per_stage=vc.num_cpus,
                                  gpus_per_stage=vc.num_gpus_per_stage or None, torch_threads=vc.torch_threads,
                                  kv_capacity_tokens=vc.kv_pool_tokens(), compile=vc.compile,
                                  early_exit=vc.early_exit,  # each stage builds the heads of its exit layers
                                  prefix_caching=vc.prefix_caching,
                                  sizing=Sizing.of(vc, cfg.target.max_model_len))  # each stage checks its pool fits
            loaded = runner.loaded
        super().__init__(cfg, replica_tag=tag, runner=runner, loaded=loaded)
        gc_policy.settle(cfg.gc_gen0_threshold)  # the weights, tokenizer and Ray's state: frozen

    def record_routing_stats(self) -> dict:
        return {"sessions": len(self.engine.sessions), "kv_tokens": self.engine.kv_tokens(),
                "pending": self.pending(), "adapters": self.versions.registry.held()}

    async def reconfigure(self, user_config: dict) -> None:
        """Serve's no-restart config update: the target versions (:meth:`VerifierCore.apply_user_config`)."""
        await self.apply_user_config(user_config)

    def check_health(self) -> None:
        if self._loop_task is not None and self._loop_task.done():
            raise RuntimeError("verify loop stopped")

    async def info(self) -> dict:
        return self.model_info()

    async def get_stats(self, session_id: str | None = None) -> dict:
        """Replica statistics; ``session_id`` routes the call to that session's replica."""
        return self.stats()


Verifier = serve.deployment(name="Verifier")(VerifierReplica)
