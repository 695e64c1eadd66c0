"""The verification engine: sessions, batched prefill, batched tree and chain verification.

Pure torch, no Ray (SpecEdge §4.1, disaggregated decoding; ``docs/engine.md``; ``docs/protocol.md``,
"One generation, end to end", steps 1, 4-6). :meth:`VerifierEngine.verify` verifies the draft
trees of many sessions in one target forward (:mod:`specdec.model.runner`), walks each tree by
sampling the target (:mod:`specdec.acceptance`), keeps the KV of the root and the accepted path
and returns the accepted node indices and the bonus token. The engine runs every forward (packing,
KV commit); its collaborators share its :class:`~specdec.session_table.SessionTable` and own the
rest of their jobs: the sessions being prefilled (:class:`specdec.prefill.PrefillQueue`) and
DSSD's chain rules (:class:`specdec.chain_verify.ChainVerifier`). Requests and results:
:mod:`specdec.engine_types`.

Guarantees: lossless (greedy: the target's argmax; sampled: the target's distribution) and batch
invariant -- a session's output is, token for token, that of decoding it alone one token at a time,
whatever batches, trees, prefill chunks and prefix-cache hits it went through. Invariant: a live
session's KV holds exactly ``prefix[:-1]``; the root ``prefix[-1]`` enters with the next forward.
Vocabulary (prefix, root, tree, node, accepted path, bonus token): :mod:`specdec.tree`.
"""

from __future__ import annotations

import itertools

import torch

from specdec import clock
from specdec.acceptance import TreeAcceptance, rejection_walk_tree, walk_tree
from specdec.chain_verify import ChainVerifier
from specdec.engine_types import (ChainVerifyRequest, ChainVerifyResult, ForwardStats, OpenRequest, OpenResult, Session,
                                  TreeJob, VerifyRequest, VerifyResult, admit_batch, tree_item)
from specdec.errors import InvalidRequest, KVStateLost, SpecError
from specdec.exit_heads import EarlyExit
from specdec.logprobs import token_logprobs
from specdec.model.batch import SeqInput
from specdec.model.runner import ModelRunner
from specdec.prefill import PrefillChunk, PrefillQueue, PrefillState, admit_open
from specdec.proposal import check_proposals
from specdec.sampling import greedy_rows
from specdec.session_table import SessionTable
from specdec.tree import TreeLimits

# the engine's public API: its requests and results are importable from here
__all__ = ["VerifierEngine", "Session", "OpenRequest", "OpenResult", "VerifyRequest", "VerifyResult",
           "ChainVerifyRequest", "ChainVerifyResult", "ForwardStats"]


class VerifierEngine:
    """Sessions of one target (and its LoRA versions) on one KV pool: :meth:`open` /
    :meth:`begin_open` + :meth:`prefill_step`, :meth:`verify`, :meth:`verify_chain`, :meth:`close`.
    Each batch method takes a list of requests and returns one result or
    :class:`~specdec.errors.SpecError` per request, in order; an invalid request touches no session.

    Its sessions are :attr:`table`'s; the sessions being prefilled are :attr:`prefill_queue`'s,
    DSSD's chain rules :attr:`chains`'."""

    def __init__(self, model, *, eos_token_ids=(), limits: TreeLimits = TreeLimits(),
                 max_model_len: int | None = None, runner=None, chain_top_k: int = 64,
                 on_forward=None, kv_capacity_tokens: int = 1 << 16, max_batch_tokens: int = 2048,
                 compile: bool = False, adapters=None, prefix_caching: bool = False):
        self.model = model
        self.runner = runner if runner is not None else ModelRunner(model, kv_capacity_tokens=kv_capacity_tokens,
                                                                    compile=compile, prefix_caching=prefix_caching)
        self.prefix_caching = prefix_caching  # (a runner passed in is built with the same setting)
        self.vocab_size = model.config.vocab_size
        self.max_batch_tokens = max_batch_tokens
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.limits = limits
        self.max_model_len = max_model_len or getattr(model.config, "max_position_embeddings", 1 << 16)
        self.table = SessionTable(self.runner, max_model_len=self.max_model_len, prefix_caching=prefix_caching,
                                  adapters=adapters)
        self.sessions: dict[str, Session] = self.table.sessions
        self.prefill_queue = PrefillQueue(self.table, vocab_size=self.vocab_size)
        self.chains = ChainVerifier(self.table, vocab_size=self.vocab_size, limits=limits, top_k=chain_top_k)
        self.on_forward = on_forward  # callback(ForwardStats)
        self._batch_ids = itertools.count()
        self.exit_heads = None  # ExitHeads: early results mid-forward for requests with ``early``
        self._on_layer = None  # the next forward's per-layer hook (exit heads)
        self.version_failures: dict[str, SpecError] = {}  # sessions closed as their version failed to load

    @property
    def prefilling(self) -> dict[str, PrefillState]:
        """Sessions being prefilled (sid -> state), in arrival order."""
        return self.prefill_queue.prefilling

    @property
    def prefix_tokens(self) -> list[int]:
        """Prompt tokens looked up in the prefix cache, and found there."""
        return self.prefill_queue.prefix_tokens

    @property
    def chain_top_k(self) -> int:
        """Head and tail candidates of a chain rejection's reply."""
        return self.chains.top_k

    @property
    def adapters(self):
        """AdapterRegistry: LoRA target versions (None: the base only)."""
        return self.table.adapters

    @adapters.setter
    def adapters(self, registry) -> None:
        self.table.adapters = registry

    # -- helpers ------------------------------------------------------------------
    def get(self, sid: str) -> Session:
        return self.table.get(sid)

    def kv_tokens(self) -> int:
        """Committed KV tokens of all sessions."""
        return self.runner.kv_tokens()

    def kv_used_tokens(self) -> int:
        """KV pool capacity the sessions hold (whole pages)."""
        return self.runner.kv_used_tokens()

    def _forward(self, kind: str, items: list[SeqInput], prefill_tokens: int = 0):
        bid = next(self._batch_ids)
        t0, c0 = clock.perf_counter(), clock.thread_time()
        versions = {it.adapter for it in items} - {None}
        if versions:  # loaded by _ready_versions already: this keeps them all for the forward
            failed = self.adapters.activate(versions)
            if failed:
                raise next(iter(failed.values()))
        try:
            hook, self._on_layer = self._on_layer, None
            logits = self.runner.forward(bid, items, **({"on_layer": hook} if hook is not None else {}))
        except KVStateLost as e:  # the runner lost its KV (a tensor-parallel rank died): those sessions end here
            self.runner.abort(bid)
            for sid in e.sessions:
                self.close(sid, cache=False)
            raise
        except BaseException:
            self.runner.abort(bid)
            raise
        finally:
            if versions:  # a forward that needed more than max_loaded versions held them all: trim back
                self.adapters.trim()
        dt = clock.perf_counter() - t0
        if self.on_forward is not None:
            self.on_forward(ForwardStats(kind, len(items), sum(len(it.tokens) for it in items), dt,
                                         prefill_tokens if kind != "prefill" else 0, clock.thread_time() - c0))
        return bid, logits

    def _commit(self, bid: int, keep: dict) -> None:
        """Apply a batch's KV commit. If that fails (a pipeline stage), the batch's sessions'
        KV is out of step: they are closed and the error names them (the replica answers
        them 410 from then on, and their edges re-open from history); no other session is touched."""
        try:
            self.runner.commit(bid, keep)
        except Exception as e:
            for sid in keep:
                self.close(sid, cache=False)
            raise KVStateLost(f"the KV commit of a batch failed ({type(e).__name__}); its sessions were "
                              "dropped: re-open from history", sessions=keep) from e

    def _forward_prefilling(self, kind: str, items: list[SeqInput], chunks: list[PrefillChunk]):
        """One forward of ``items`` with prefill ``chunks`` riding along after them."""
        try:
            return self._forward(kind, items + [c.item for c in chunks], sum(c.n for c in chunks))
        except SpecError:  # the pool is full: the sessions being prefilled fail, the rest goes on
            self.prefill_queue.fail(chunks)
            raise

    @staticmethod
    def _fail_versions(jobs: list, out: list, failed: dict[str, SpecError]) -> list:
        """Jobs whose version failed to load get its error as their result; the others go on."""
        for j in jobs:
            if j.session.adapter in failed:
                out[j.index] = failed[j.session.adapter]
        return [j for j in jobs if j.session.adapter not in failed]

    # -- open (prefill: specdec.prefill) -----------------------------------------
    def open(self, requests: list[OpenRequest]) -> list[OpenResult | SpecError]:
        """Prefill new (or re-opened) sessions to the end; sample first tokens."""
        out: list[OpenResult | SpecError | None] = list(self.begin_open(requests))
        index = {r.sid: i for i, r in enumerate(requests) if out[i] is None}
        while any(sid in self.prefill_queue for sid in index):
            for res in self.prefill_step(self.max_batch_tokens, only=set(index)):
                if res.sid in index:
                    out[index[res.sid]] = res
        for sid, e in self.take_version_failures().items():  # their version failed to load
            if sid in index and out[index[sid]] is None:
                out[index[sid]] = e
        return out  # type: ignore[return-value]

    def begin_open(self, requests: list[OpenRequest]) -> list[SpecError | None]:
        """Validate and queue sessions for prefill; an error per invalid request, else None."""
        out: list[SpecError | None] = [None] * len(requests)
        for i, r in enumerate(requests):
            try:
                if r.sid in self.sessions or r.sid in self.prefill_queue:  # twice would share one KV
                    raise InvalidRequest(f"session {r.sid!r} already exists")
                state = admit_open(r, self.vocab_size, self.max_model_len, self.eos_token_ids)
                self.table.check_version(r.adapter)
                self.prefill_queue.add(state)
            except SpecError as e:
                out[i] = e
        return out

    def prefill_step(self, budget_tokens: int, only: set[str] | None = None) -> list[OpenResult]:
        """One forward over at most ``budget_tokens`` queued prompt tokens (first come, first
        served; ``only``: these sessions); returns the sessions whose prefill completed, with
        their first token."""
        chunks = self.prefill_queue.take(budget_tokens, only)
        if self._ready_versions({c.state.session.adapter for c in chunks}):
            chunks = self.prefill_queue.still_queued(chunks)
        if not chunks:
            return []
        bid, logits = self._forward_prefilling("prefill", [], chunks)
        self._commit(bid, self.prefill_queue.keep(chunks))
        return self.prefill_queue.finish(chunks, logits)

    def take_late(self) -> list[str]:
        """Opens dropped since the last call, still waiting behind another prompt at their
        ``start_by`` (an open's deadline, issue 67); nothing was computed for them."""
        return self.prefill_queue.take_late()

    def take_opened(self) -> list[OpenResult]:
        """Opens completed by prefill chunks that rode along with verify forwards."""
        return self.prefill_queue.take_opened()

    # -- close --------------------------------------------------------------------
    def close(self, sid: str, cache: bool = True) -> None:
        """End a session; its committed KV is offered to later prompts unless ``cache`` is False
        (KV that may be out of step)."""
        s = self.sessions.pop(sid, None)
        if s is not None and cache and self.prefix_caching:
            self.table.cache(s)
        self.runner.drop(sid)
        self.prefill_queue.discard(sid)

    # -- prefix caching -----------------------------------------------------------------
    def prefix_cache_stats(self) -> dict | None:
        """Prompt tokens looked up in the prefix cache and found there, and (a local runner) its
        pages cached and idle; None when prefix caching is off."""
        if not self.prefix_caching:
            return None
        return {"query_tokens": self.prefix_tokens[0], "hit_tokens": self.prefix_tokens[1],
                **(self.runner.prefix_stats() or {})}

    # -- target versions (LoRA adapters) ------------------------------------------------
    def _ready_versions(self, names: set) -> dict[str, SpecError]:
        """Load the versions a forward needs (on first use; LRU-evicting others,
        :mod:`deploy.verifier.adapters`) before it is packed. A version that cannot be loaded
        fails its sessions only: they are closed, their errors kept for
        :meth:`take_version_failures` (the batch's own requests of it get the error as their
        result); the forward goes on without them."""
        names = set(names) - {None}
        if not names:
            return {}
        failed = self.adapters.activate(names)
        for name, e in failed.items():
            for sid in self.drop_versions({name}):
                self.version_failures[sid] = e
        return failed

    def take_version_failures(self) -> dict[str, SpecError]:
        """Sessions (live or prefilling) closed because their version failed to load -> the error."""
        out, self.version_failures = self.version_failures, {}
        return out

    def drop_versions(self, names: set[str]) -> list[str]:
        """Close every session (live or prefilling) of these versions; their ids."""
        gone = [sid for sid, s in self.sessions.items() if s.adapter in names]
        gone += [sid for sid, p in self.prefilling.items() if p.session.adapter in names]
        for sid in gone:
            self.close(sid, cache=False)
        for name in names:  # a re-pointed version must not read the old one's cached KV
            self.table.version_epoch[name] = self.table.version_epoch.get(name, 0) + 1
        return gone

    # -- verify -------------------------------------------------------------------
    def verify(self, requests: list[VerifyRequest], prefill_tokens: int = 0,
               on_early=None) -> list[VerifyResult | SpecError]:
        """Verify the trees of many sessions in one target forward.

        Invalid requests get their error back and do not touch any session; the others
        are verified together. An empty tree is one plain decoding step. ``prefill_tokens``:
        up to that many queued prompt tokens ride along in the same forward (chunked
        prefill); opens they complete are collected by :meth:`take_opened`. ``on_early``:
        a sink for exit heads' early results of requests with ``early`` (:mod:`specdec.exit_heads`).
        """
        out, jobs = admit_batch(requests, self._admit_tree, TreeJob)
        if not jobs:
            return out  # type: ignore[return-value]
        chunks = self.prefill_queue.take(prefill_tokens) if prefill_tokens > 0 else []
        failed = self._ready_versions({j.session.adapter for j in jobs} | {c.state.session.adapter for c in chunks})
        if failed:  # a version that cannot be loaded fails its own sessions, not the batch
            jobs = self._fail_versions(jobs, out, failed)
            chunks = self.prefill_queue.still_queued(chunks)
            if not jobs:
                return out  # type: ignore[return-value]
        items = [tree_item(j.session, j.tree) for j in jobs]
        if on_early is not None and self.exit_heads is not None:  # exit heads walk the trees mid-forward
            self._on_layer = EarlyExit.for_batch(self, requests, jobs, on_early)
        bid, logits = self._forward_prefilling("verify", items, chunks)
        logits, pre_logits = logits[: len(items)], logits[len(items):]
        logits = [lg if j.session.grammar is None else j.session.grammar.apply(lg, j.tree) for j, lg in zip(jobs, logits)]
        # on a GPU, every row's argmax in one launch and one copy (not a launch and a sync per visited row)
        argmax = greedy_rows(logits) if logits and logits[0].is_cuda else [None] * len(logits)
        walks = [self._walk_tree(j, lg, top) for j, lg, top in zip(jobs, logits, argmax)]
        keep = self.prefill_queue.keep(chunks)
        for j, acc in zip(jobs, walks):
            root = len(j.session.prefix) - 1  # node a was written at root + 1 + a
            keep[j.session.sid] = (1, [root + 1 + a for a in acc.accepted])  # the root and the accepted path
        self._commit(bid, keep)  # before emitting, which drops the KV of sessions that finish
        self.prefill_queue.finish(chunks, pre_logits, hold=True)
        for j, lg, acc in zip(jobs, logits, walks):
            out[j.index] = self._reply_tree(j, lg, acc)
        return out  # type: ignore[return-value]

    def _admit_tree(self, i: int, r: VerifyRequest) -> TreeJob:
        """Validate request ``i`` (raising its error) into a job: its tree truncated to ``limit``
        and clipped to the context left, its proposals checked."""
        s = self.table.live(r.sid, r.prefix_len)
        if s.awaiting_resample:
            raise InvalidRequest(f"session {r.sid!r} owes a chain-mode resampled token")
        tree = r.tree.validate(self.vocab_size, self.limits)
        props = None
        if r.proposals is not None:  # a value-dependent cut would bias it: never truncated
            try:
                props = check_proposals(tree, r.proposals, self.vocab_size)
            except ValueError as e:
                raise InvalidRequest(f"tree rejection sampling: {e}") from None
        elif r.limit is not None and 0 <= r.limit < len(tree):
            tree = tree.prefix(r.limit)
        verified = len(tree)
        # a node of depth d sits at position len(prefix) - 1 + d: near the end of the
        # context the deeper nodes are cut (the session then ends with "length")
        room = self.max_model_len - len(s.prefix)
        tree, kept = tree.clip(room) if tree.depth > room else (tree, None)
        if props is not None and kept is not None:  # the clip depends on depth only: still exact
            props = (props[0],) + tuple(None if not tree.children[j + 1] else props[k + 1]
                                        for j, k in enumerate(kept))
        return TreeJob(i, s, tree, kept, verified, props)

    def _walk_tree(self, job: TreeJob, logits: torch.Tensor, argmax: list[int] | None) -> TreeAcceptance:
        """Walk a job's tree with its rows (``logits`` [n + 1, vocab]; ``argmax``: their greedy tokens)."""
        s = job.session
        pen = s.penalties(self.vocab_size, logits.device)
        if job.proposals is None:
            return walk_tree(job.tree, logits, s.params, s.generator, max_emit=self.table.remaining(s),
                             stop_ids=s.stop_ids, penalties=pen, argmax=argmax)
        return rejection_walk_tree(job.tree, logits, job.proposals, s.params, s.generator,
                                   max_emit=self.table.remaining(s), stop_ids=s.stop_ids, penalties=pen)

    def _reply_tree(self, job: TreeJob, logits: torch.Tensor, acc: TreeAcceptance) -> VerifyResult:
        """Emit a walked tree's tokens; the reply names nodes of the tree the edge sent."""
        s, tree = job.session, job.tree
        path = acc.accepted if job.kept is None else tuple(job.kept[a] for a in acc.accepted)
        emitted = [tree.tokens[a] for a in acc.accepted] + [acc.bonus]
        lps = None
        if s.params.logprobs is not None:  # row 0 emitted the first token, node a's row the one after it
            lps = token_logprobs(logits[[0] + [a + 1 for a in acc.accepted]], emitted, s.params.logprobs)
        s.last_used = clock.monotonic()
        self.table.emit(s, emitted)
        return VerifyResult(s.sid, path, acc.bonus, tuple(emitted), len(s.prefix), s.finished, s.finish_reason,
                            job.verified, lps)

    # -- chain drafts (DSSD: specdec.chain_verify) ---------------------------------
    def verify_chain(self, requests: list[ChainVerifyRequest]) -> list[ChainVerifyResult | SpecError]:
        """Chain drafts with rejection sampling (DSSD), batched like trees: one result or error
        per request, in order; an invalid request leaves its session intact."""
        out, todo = self.chains.admit(requests)
        todo = self._fail_versions(todo, out, self._ready_versions({j.session.adapter for j in todo}))
        if not todo:
            return out
        bid, logits = self._forward("chain", [self.chains.item(j) for j in todo])
        walks = [self.chains.walk(j, lg) for j, lg in zip(todo, logits)]
        # a chain's accepted nodes follow the root in place
        self._commit(bid, {j.session.sid: (1 + len(accepted), []) for j, (_acc, accepted) in zip(todo, walks)})
        for j, (acc, accepted) in zip(todo, walks):
            out[j.index] = self.chains.reply(j.session, acc, accepted)
        return out
