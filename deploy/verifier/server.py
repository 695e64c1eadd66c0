"""Verifier replica core: the target, the engine, and the edge protocol's requests (SpecEdge §4.3).

Everything of a replica but Serve (:mod:`deploy.verifier.deployment`); imports no Ray. Every engine
call runs on one worker thread, so a close never races a forward. Methods return ``(status, payload)``
rather than raising, so errors cross the Ray boundary as plain data. Tour: docs/verifier.md, "The replica".
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from deploy.config import AppConfig
from deploy.metrics import RoundStats, VerifierMetrics
from deploy.prefill_forecast import PrefillForecast
from deploy.verifier.batch_fill import ArrivalModel
from deploy.verifier.batch_loop import BatchLoop
from deploy.verifier.counters import ReplicaCounters
from deploy.verifier.early_stream import EarlyStreams
from deploy.verifier.eviction import Limits, choose_victims, within_limits
from deploy.verifier.grammars import ReplicaGrammars
from deploy.verifier.hints import SessionHints
from deploy.verifier.open_queue import OpenQueue
from deploy.verifier.pacing import Pacer
from deploy.verifier.prefill_budget import PrefillBudget
from deploy.verifier.queued_round import QueuedRound, answer, answer_each, error_reply, internal_reply
from deploy.verifier.rules import RULES
from deploy.verifier.run_ahead import AheadRuns, RunAhead
from deploy.verifier.scheduler import FairScheduler, Pending
from deploy.verifier.sessions import EdgeClient, SessionBook
from deploy.verifier.startup import start_target, warm_up
from deploy.verifier.version_updates import VersionUpdates
from deploy.verifier.versions import TargetVersions
from specdec import clock
from specdec.engine import ChainVerifyRequest, ForwardStats, OpenRequest, OpenResult, VerifyRequest
from specdec.errors import InvalidRequest, ModelNotFound, SessionEvicted, SpecError, TokenizerMismatch
from specdec.model.loading import tokenizer_fingerprint
from specdec.protocol import VerifyFrame
from specdec.rules import import_rule_modules
from specdec.sampling import SamplingParams
from specdec.truncation import GainCalibration, choose_prefixes

log = logging.getLogger("ray.serve")


class VerifierServer:
    """A verifier replica without Serve: its target, sessions, batch loop and request handlers."""

    def __init__(self, config: AppConfig, replica_tag: str = "local", runner=None, loaded=None, executor=None,
                 new_id=None):
        """``runner``/``loaded``: built elsewhere (pipeline, simulation); ``executor``, ``new_id``: a simulation's."""
        self.cfg = config
        vc, p = config.verifier, config.pacing
        if vc.torch_threads:
            torch.set_num_threads(vc.torch_threads)
        self.tag, self._warming = replica_tag, vc.warmup  # the warm-up's forwards are not measured (see the end)
        import_rule_modules(vc.rule_modules)
        started = start_target(config, self._on_forward, runner, loaded)  # KV pool sized from memory
        self.loaded, self.engine, self.kv_plan = started.loaded, started.engine, started.kv_plan
        # exit heads: early results mid-forward for edges that ask (deploy/verifier/early_stream.py)
        self.early = EarlyStreams.attach(self.engine, vc.early_exit, self.loaded.model)
        budgets = tuple(b for b in p.tree_budgets if b <= vc.max_tree_nodes) or (vc.max_tree_nodes,)
        self.pacer = Pacer(p.min_depth, min(p.max_depth, vc.max_tree_depth), p.default_depth, budgets,
                           min(p.default_tree_budget, vc.max_tree_nodes), p.ema,
                           round_overhead_s=p.round_overhead_ms / 1000.0, tree_margin=p.tree_margin,
                           fill=vc.batch_fill)
        tenants = config.router.load_tenants()  # reads router.tenants_file, once
        self._limits = Limits(self.kv_plan.budget_tokens, vc.max_sessions,
                              quotas={tn.name: tn.kv_quota_tokens for tn in tenants if tn.kv_quota_tokens},
                              weights={tn.name: tn.weight for tn in tenants})
        self.metrics = VerifierMetrics.create([tn.name for tn in tenants])
        self.sessions = SessionBook()
        self.counters = ReplicaCounters()
        self.arrivals = ArrivalModel()  # when each session's next round is due (batch filling)
        self.prefill = PrefillBudget(vc, self.pacer.cost)
        # opens from arrival to first token, admitted against their deadlines (deploy/verifier/open_queue.py)
        self.opens = OpenQueue(PrefillForecast(retry_after_s=config.router.retry_after_s))
        self.loop = BatchLoop(vc, FairScheduler(weights={tn.name: tn.weight for tn in tenants}), self.engine,
                              self.pacer.cost, self.prefill, self.arrivals, self.counters, self.opens)
        # LoRA target versions (FlexSpec): multiplexed adapters, per-version pacing (deploy/verifier/versions.py)
        self.versions = TargetVersions(self.engine, self.loaded.name, config.target, p, self.pacer)
        self.hints = SessionHints(self.versions, self.sessions, self.engine, p.sessions_hold_s)
        self.runs = AheadRuns(vc.run_ahead_tokens, self.counters.takeovers)
        self.fingerprint = tokenizer_fingerprint(self.loaded.tokenizer)
        self.grammars = ReplicaGrammars.of(self.loaded, vc)  # structured output (deploy/verifier/grammars.py)
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
        self._new_id = new_id or (lambda: uuid.uuid4().hex)
        self.calibration = GainCalibration()  # draft path probability -> observed acceptance
        self.version_updates = VersionUpdates(config, self.versions, self.engine, self._on_worker,
                                              self._end_version_session)
        if vc.warmup:  # before the replica reports ready; its forwards are no one's measurements
            warm_up(self.engine, self.loaded.vocab_size)
        self._warming = False

    @property
    def owner(self) -> dict[str, str]:
        """Session id -> tenant, of the live sessions (read by :class:`deploy.metrics.VerifierState`)."""
        return self.sessions.owner

    # -- info ---------------------------------------------------------------------
    def model_info(self) -> dict:
        vc = self.cfg.verifier
        return {"model": self.loaded.name, "vocab_size": self.loaded.vocab_size,
                "eos_token_ids": list(self.loaded.eos_token_ids), "tokenizer_fingerprint": self.fingerprint,
                "max_tree_nodes": vc.max_tree_nodes, "max_tree_depth": vc.max_tree_depth,
                "max_model_len": self.engine.max_model_len, **self.early.info()}

    def stats(self) -> dict:
        a, b, knee = self.pacer.cost.coefficients()
        return {"replica": self.tag, "sessions": len(self.engine.sessions), "kv_tokens": self.engine.kv_tokens(),
                "kv_used_tokens": self.engine.kv_used_tokens(), **self.kv_plan.stats(),
                **self.counters.to_dict(), "pending": self.pending(),
                "forward_cost_a": a, "forward_cost_b": b, "forward_cost_knee": knee,
                "forward_cost_points": [[x, t, n] for x, t, n in sorted(self.pacer.cost.points())],
                "pacing": self.pacer.state(), "pacing_classes": self.versions.states(),
                "prefix_cache": self.engine.prefix_cache_stats(), "open_forecast": self.opens.forecast.state(),
                "evictions": len(self.sessions.evicted), "versions": self.versions.registry.served(),
                "versions_unavailable": dict(self.versions.registry.unavailable),
                "versions_error": self.version_updates.error}

    def pending(self) -> int:
        """Requests waiting for the engine: verify rounds and opens (queued or prefilling)."""
        return len(self.loop.sched) + len(self.opens)

    def _on_forward(self, st: ForwardStats) -> None:
        if self._warming:
            return
        self.prefill.observe(st)  # before the cost curve sees it: a chunk is costed against the curve
        if st.kind != "prefill":
            self.pacer.observe_forward(st.tokens, st.seconds)
        self.counters.on_forward(st)
        self.metrics.on_forward(st)

    # -- the batch loop's steps (deploy.verifier.batch_loop) --------------------------------
    async def _run_steps(self, steps) -> None:
        """Run each step the batch loop decides on; one bad step never stops the loop."""
        loop = asyncio.get_running_loop()
        async for step in steps:
            self.metrics.refresh(self)
            try:
                if step.sweep:
                    await self.sweep_idle()
                elif step.opens:
                    await self.begin_opens(loop, step.opens)
                elif step.batch:
                    await self.run_verifies(loop, step.batch)
                elif step.prefill:
                    await self.run_prefill(loop, step.prefill)
            except Exception as e:
                log.exception("verify loop error: %s", e)

    def _on_worker(self, fn, *args):
        """Run ``fn(*args)`` on the worker thread (awaitable), after any forward queued there."""
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- session bookkeeping --------------------------------------------------------
    async def _evict(self, sid: str, reason: str) -> None:
        # on the worker thread, like every engine call: never beside a forward or a close
        await self._on_worker(self.engine.close, sid)
        self._forget(sid, reason)

    def _forget(self, sid: str, reason: str) -> None:
        """A session the engine no longer holds: its requests answer 410 from now on."""
        self._drop(sid)
        self.sessions.evict(sid, reason)
        self.metrics.on_evict(sid, reason)

    def _drop(self, sid: str) -> None:
        """The replica's own records of a session (the engine's are dropped on the worker thread)."""
        self.runs.detached.pop(sid, None)
        self.sessions.drop(sid)
        self.arrivals.forget(sid)

    def _reply_sent(self, sid: str, now: float, back: bool, finished: bool) -> None:
        """A reply goes out: the edge is expected ``back`` (else forgotten); see :meth:`_close_if_finished`."""
        if back:
            self.arrivals.replied(sid, now)
        else:
            self.arrivals.forget(sid)
        self._close_if_finished(sid, finished)

    def _close_if_finished(self, sid: str, finished: bool) -> None:
        """A finished ``close_on_finish`` session closes with its reply (then 410; a close 200)."""
        if not finished or not self.sessions.closes_on_finish(sid):
            return
        self._drop(sid)
        self.sessions.close_finished(sid)
        # on the worker thread, like every engine call: after any forward already queued there
        self._on_worker(self.engine.close, sid)

    async def _enforce_budgets(self, protect: set[str]) -> None:
        """Evict above a tenant's KV quota, the KV budget or the session limit (:mod:`deploy.verifier.eviction`)."""
        live = self.engine.sessions
        if within_limits(self._limits, len(live), self.sessions.kv_held(live)):
            return  # the common case, without a list of every session sorted by last use
        for sid in choose_victims(self.sessions.uses(live), self._limits, frozenset(protect)):
            await self._evict(sid, "kv_budget")

    async def sweep_idle(self) -> int:
        now = clock.monotonic()
        pending = self.loop.sched.pending_sessions()
        idle = [sid for sid, s in self.engine.sessions.items()
                if now - s.last_used > self.cfg.verifier.idle_timeout_s and sid not in pending]
        for sid in idle:
            await self._evict(sid, "idle_timeout")
        self.arrivals.prune(self.engine.sessions)
        return len(idle)

    # -- requests ---------------------------------------------------------------------
    async def open_session(self, tenant: str, body: dict, deadline_s: float | None = None) -> tuple[int, dict]:
        """Open a session; ``deadline_s``: how long it may wait for the prefills queued ahead of it
        (:mod:`deploy.verifier.open_queue`)."""
        try:
            prompt = [int(t) for t in body["prompt_ids"]]
            generated = tuple(int(t) for t in body.get("generated_ids") or ())
            if len(prompt) + len(generated) > self.cfg.verifier.max_prompt_tokens:
                raise InvalidRequest(f"prompt + history exceed {self.cfg.verifier.max_prompt_tokens} tokens")
            params = SamplingParams.from_dict(body.get("sampling")).validate(self.loaded.vocab_size)
            TokenizerMismatch.check((body.get("client") or {}).get("tokenizer_fingerprint"), self.fingerprint)
            version = self.versions.resolve(body.get("model"))
            grammar = await self.grammars.state_of(body.get("grammar"))
        except SpecError as e:
            return error_reply(e)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            return error_reply(InvalidRequest(f"malformed open request: {e}"))
        if deadline_s is not None and (refused := self.opens.forecast.refusal(deadline_s)) is not None:
            return error_reply(refused)
        sid = f"{self.tag}.{self._new_id()}"
        fut = asyncio.get_running_loop().create_future()
        self.loop.ensure(self._run_steps)
        req = OpenRequest(sid, prompt, params, generated, adapter=version, cache_salt=tenant,  # shares within a tenant
                          start_by=None if deadline_s is None else clock.monotonic() + deadline_s, grammar=grammar)
        self.metrics.on_arrival(sid)
        self.sessions.client[sid] = EdgeClient.of_open(body, self.runs.tokens(params.logprobs is None),
                                                       params.logprobs is not None)
        self.loop.kick()
        return await self.opens.wait(req, tenant, fut, deadline_s)

    async def verify(self, session_id: str, tenant: str, frame: bytes) -> tuple[int, bytes | dict]:
        try:
            f = VerifyFrame.decode(frame, max_nodes=self.cfg.verifier.max_tree_nodes)
            self.sessions.check(session_id, tenant)
            rule = RULES.get(f.rule_name)
            req = rule.request(session_id, f, self.early.accept(f) if rule.early else False)
        except SpecError as e:
            return error_reply(e)
        edge = self.sessions.client.setdefault(session_id, EdgeClient())
        if f.draft_ms or f.rtt_ms:
            edge.draft_ms, edge.rtt_ms = f.draft_ms, f.rtt_ms
        edge.ahead = ahead = self.runs.tokens(f.ahead and not edge.logprobs)
        self.metrics.on_frame(tenant, f)
        fut = asyncio.get_running_loop().create_future()
        self.loop.ensure(self._run_steps)
        gains = rule.gains(f) if self.cfg.verifier.truncate_trees else []
        now = clock.monotonic()
        self.arrivals.arrived(session_id, now)
        if session_id in self.runs.detached:  # the request takes its session's detached run over
            try:
                run = self.runs.take_over(session_id, f, fut)
            except SpecError as e:
                return error_reply(e)
            out = await fut if run.queued else self._run_reply(tenant, session_id, run, *self.hints.hints(session_id))
        else:
            run = RunAhead(ahead - 1, f.prefix_len, fut, len(f.tokens)) if ahead > 1 else None
            round_ = QueuedRound(req, fut, gains, run, rule)
            self.loop.enqueue(Pending(tenant, session_id, len(f.tokens) + 1, round_, now))
            out = await fut
        self.counters.on_request(clock.monotonic() - now)  # queue, batch wait, forward(s), reply
        return out

    async def verify_stream(self, session_id: str, tenant: str, frame: bytes):
        """:meth:`verify` as a stream: early frames (``F_EARLY``), then ``("final", status, payload)``."""
        async for item in self.early.stream(session_id, self.verify(session_id, tenant, frame)):
            yield item

    async def close_session(self, session_id: str, tenant: str) -> tuple[int, dict]:
        try:
            self.sessions.check(session_id, tenant)
        except SessionEvicted:
            self.sessions.pardon(session_id)
            return 200, {"closed": session_id}
        except SpecError as e:
            return error_reply(e)
        # on the worker thread: never while a forward that holds this session runs
        await self._on_worker(self.engine.close, session_id)
        self._drop(session_id)
        return 200, {"closed": session_id}

    async def update_versions(self, adapters: dict[str, str], max_loaded: int) -> dict:
        """Add, remove or re-point target versions without a restart (:mod:`deploy.verifier.version_updates`)."""
        return await self.version_updates.update(adapters, max_loaded)

    async def apply_user_config(self, user_config: dict) -> None:
        """The Serve ``user_config`` (``reconfigure``): the target versions, validated first."""
        await self.version_updates.apply_user_config(user_config)

    def _end_version_session(self, sid: str, gone: set[str]) -> None:
        """A session whose target version was removed answers 404 (a prefilling open now)."""
        self.sessions.client.pop(sid, None)
        if sid in self.opens.prefilling:
            self.opens.fail(sid, error_reply(ModelNotFound(
                f"the target version of this session was removed from this server ({sorted(gone)})")))
        else:
            self._forget(sid, "model_removed")

    # -- forwards and their answers -------------------------------------------------------
    async def begin_opens(self, loop, opens) -> None:
        try:
            errors = await loop.run_in_executor(self._executor, self.engine.begin_open, [o.req for o in opens])
        except Exception as e:
            log.exception("queueing opens failed")
            errors = [e] * len(opens)
        for o, err in zip(opens, errors):
            if err is not None:
                self.sessions.client.pop(o.req.sid, None)
                answer(o.fut, error_reply(err) if isinstance(err, SpecError) else internal_reply(err))
            else:
                self.opens.begun(o)

    def _answer_late(self) -> None:
        """The opens the engine dropped at their deadline, waiting behind another prompt: 429."""
        for sid in (late := self.engine.take_late()):
            self.sessions.client.pop(sid, None)
        self.opens.late(late)

    async def run_prefill(self, loop, budget: int) -> None:
        try:
            results = await loop.run_in_executor(self._executor, self.engine.prefill_step, budget)
        except SpecError as e:  # the KV pool is full: the opens the engine dropped fail with a clear error
            results = []
            self._fail_dropped_opens(e)
        except Exception as e:
            log.exception("prefill failed")
            self._answer_late()
            for sid in list(self.opens.prefilling):
                await loop.run_in_executor(self._executor, self.engine.close, sid)
                self.sessions.client.pop(sid, None)
                self.opens.fail(sid, internal_reply(e))
            return
        self._answer_late()
        self._settle_version_failures()
        await self._complete_opens(loop, results)

    def _fail_dropped_opens(self, e: SpecError) -> None:
        """Answer the opens whose prefill the engine gave up (a full KV pool)."""
        self._answer_late()  # those it dropped at their deadline first: a 429 of their own
        for sid in [sid for sid in self.opens.prefilling if sid not in self.engine.prefilling]:
            self.sessions.client.pop(sid, None)
            self.opens.fail(sid, error_reply(e))

    async def _complete_opens(self, loop, results: list[OpenResult]) -> None:
        answers = []
        for res in results:
            tenant, fut = self.opens.pop(res.sid)
            if fut.done():  # the client went away while its prompt was prefilled
                await loop.run_in_executor(self._executor, self.engine.close, res.sid)
                self.sessions.client.pop(res.sid, None)
                continue
            self.sessions.owner[res.sid] = tenant
            answers.append((fut, (tenant, res)))
        if results:  # before answering: an open's reply reports the replica after its evictions
            await self._enforce_budgets(protect={r.sid for r in results})
        answer_each(answers, self._open_reply)

    def _open_reply(self, item: tuple[str, OpenResult]) -> tuple[int, dict]:
        tenant, res = item
        self.metrics.on_open(tenant, res.sid, res.prefix_len, res.cached_tokens, first_token=res.first_token is not None,
                             finish_reason=res.finish_reason if res.finished else None)
        self.counters.tokens_emitted += res.first_token is not None
        now = clock.monotonic()
        if not res.finished:
            self.arrivals.replied(res.sid, now)
        depth, budget = self.hints.hints(res.sid)
        self._queue(self.runs.from_open(tenant, res, self.sessions.client.get(res.sid), budget, now))
        reply = (200, {
            "session_id": res.sid, "first_token": res.first_token, "prefix_len": res.prefix_len,
            "first_logprob": res.first_logprob.to_dict() if res.first_logprob is not None else None,
            "cached_tokens": res.cached_tokens, "finished": res.finished, "finish_reason": res.finish_reason,
            "depth_hint": depth, "budget_hint": budget, "tokenizer_fingerprint": self.fingerprint,
            "model": self.versions.name_of(res.sid), "close_on_finish": self.sessions.closes_on_finish(res.sid)})
        self._close_if_finished(res.sid, res.finished)
        return reply

    async def run_verifies(self, loop, batch: list[Pending]) -> None:
        trees = [(p, p.payload.req) for p in batch if isinstance(p.payload.req, VerifyRequest)]
        chains = [(p, p.payload.req) for p in batch if isinstance(p.payload.req, ChainVerifyRequest)]
        self.metrics.on_batch_start(batch)
        waiting = len(self.opens.prefilling)
        prefill = self.prefill.chunk(batch, waiting, self.arrivals) if waiting else 0
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
                answer(p.payload.answers, self._so_far(p) or error_reply(e))
            for sid in getattr(e, "sessions", ()):  # KVStateLost: the engine dropped them
                if sid in self.sessions.owner:
                    self._forget(sid, "kv_state_lost")
            self._fail_dropped_opens(e)
            return
        except Exception as e:
            log.exception("verify forward failed")
            self._answer_late()
            for p in batch:
                answer(p.payload.answers, self._so_far(p) or internal_reply(e))
            return
        self._answer_late()
        self._settle_version_failures()
        # a forward of trees alone: no run-ahead step (an empty tree) in it. A tree round of an edge that
        # takes run-ahead replies (F_AHEAD, the agent's default) carries a run too, so the test is the tree
        if trees and not chains and all(len(r.tree) for _, r in trees):
            self.pacer.observe_tree_batch(self.hints.load_sessions(), len(batch))
        answer_each([(p.payload.answers, (p, res)) for p, res in results], self._round_reply)
        await self._complete_opens(loop, opened)

    def _settle_version_failures(self) -> None:
        """Sessions closed as their version failed to load answer 503 ``model_unavailable`` (an open now)."""
        for sid, e in self.engine.take_version_failures().items():
            self.sessions.client.pop(sid, None)
            if sid in self.opens.prefilling:
                self.opens.fail(sid, error_reply(e))
            elif sid in self.sessions.owner:
                self._forget(sid, f"model_unavailable: {e.message}")

    def _truncate(self, trees: list, base_rows: int) -> list:
        """Server-side truncation at batch time (:mod:`specdec.truncation`)."""
        if not trees or not self.cfg.verifier.truncate_trees or self.pacer.cost.count < 3:
            return trees
        whole = [(p, r) for p, r in trees if r.proposals is not None]  # sampled trees: never cut by value
        trees = [(p, r) for p, r in trees if r.proposals is None]
        gains = [self.calibration.scale(p.payload.gains) for p, _ in trees]
        take = choose_prefixes(gains, self.pacer.cost.predict, base_rows + sum(len(r.tree) + 1 for _, r in whole))
        return whole + [(p, VerifyRequest(r.sid, r.tree, r.prefix_len, n, early=r.early))
                        for (p, r), n in zip(trees, take)]

    def _round_reply(self, item) -> tuple[int, bytes | dict] | None:
        """Bookkeeping and the reply frame of one verified round; None while its run-ahead decodes on."""
        p, res = item
        req, gains, run = p.payload.req, p.payload.gains, p.payload.run
        if isinstance(res, SpecError):
            return self._so_far(p) or error_reply(res)
        rule = p.payload.rule
        # chain mode: a rejected round has no bonus; the residual sample it owes arrives (and is
        # emitted) with the next request, and counts there
        rs = RoundStats.of(p.tenant, req, res)
        n_nodes, emitted = rs.draft_tokens, rs.emitted
        if gains:
            self.calibration.observe(sum(gains[:n_nodes]), len(res.accepted))
        refill = rule.refill(req)
        if not refill:
            self.hints.pacing(p.session_id)[0].observe_round(n_nodes + rs.truncated, emitted, n_nodes)
        self.counters.tokens_emitted += emitted
        now = clock.monotonic()
        self.counters.round_latencies.append((p.enqueued_at, now - p.enqueued_at))
        version = self.versions.label(p.session_id)
        if run is not None and (self._queue(self.runs.advance(p, res, self.hints.best_budget(p.session_id), now))
                                or run.fut is None):
            self.metrics.on_round(p.tenant, p.session_id, req, res, 0, 0, version=version)
            return None  # decoding on, or detached and stopped: its tokens wait for the next request
        depth, budget = self.hints.hints(p.session_id)
        if not refill:
            self.metrics.on_round(p.tenant, p.session_id, req, res, depth, budget, version=version)
        if run is not None:
            return self._run_reply(p.tenant, p.session_id, run, depth, budget)
        frame = rule.reply(req, res, depth, budget)
        self._reply_sent(p.session_id, now, not (res.finished or refill), res.finished)
        return 200, frame.encode()

    def _run_reply(self, tenant: str, sid: str, run: RunAhead, depth: int, budget: int) -> tuple[int, bytes]:
        """A run-ahead request's reply (:mod:`deploy.verifier.run_ahead`)."""
        now = clock.monotonic()
        self._queue(self.runs.replied(tenant, sid, run, budget, now))
        self._reply_sent(sid, now, not run.ended, run.last.finished)
        return 200, run.frame(depth, budget).encode()

    def _so_far(self, p: Pending) -> tuple[int, bytes] | None:
        """A failed round's run-ahead reply with the tokens decoded so far (None: not owed one)."""
        run = self.runs.so_far(p)
        return None if run is None else (200, run.frame(*self.hints.hints(p.session_id)).encode())

    def _queue(self, step: Pending | None) -> Pending | None:
        if step is not None:
            self.loop.enqueue(step)
        return step
