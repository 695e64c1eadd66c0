"""The verification engine: sessions, batched prefill, batched tree verification.

Pure torch, no Ray (docs/protocol.md, "One generation, end to end", steps 1, 4-6; SpecEdge
§4.1 "disaggregated decoding"):
the edge sends a draft tree for a session; the engine verifies trees of many sessions
in **one** target forward (every session's tokens packed on one axis, tree attention by
ancestor bitmasks, positions = prefix length + depth, KV read and written in place in
the pool: :mod:`specdec.model.runner`), walks each tree by sampling the target
(:mod:`specdec.acceptance`), keeps the KV of the root and the accepted path,
and replies with the accepted node indices and the bonus token.

Prefill is chunked and token-budgeted: :meth:`VerifierEngine.begin_open` queues new
sessions, :meth:`VerifierEngine.prefill_step` runs one forward over at most a given number
of prompt tokens, so a long prompt never holds up other sessions' verify rounds (the
replica's loop interleaves them); :meth:`VerifierEngine.open` runs a queue to the end.

Batch invariance: a row's logits depend only on its own logical sequence
(:mod:`specdec.model.decoder`), so in every dtype a session's output is the same whatever
batches, trees and prefill chunks it went through: token for token the output of
decoding one token at a time with this engine.

Prefix caching (``prefix_caching``, :mod:`specdec.model.prefix_cache`): a prompt's first
chunk starts on the cached KV pages of its longest cached prefix, and a session's whole pages
are offered to later ones as its prefill proceeds and when it finishes or closes. Sharing is
within one ``cache_salt`` (the tenant) and one target version; batch invariance makes it exact.

Vocabulary (prefix, root, tree, node, accepted path, bonus token): see
:mod:`specdec.tree`. Invariant: a live session's KV holds exactly
``prefix[:-1]``; the root ``prefix[-1]`` enters the KV with the next forward.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specdec.errors import (InvalidRequest, KVStateLost, ModelNotFound, PrefixMismatch, SessionFinished,
                           SessionNotFound, SpecError)
from specdec.acceptance import (ChainAcceptance, more_candidates, rejection_sample_chain, rejection_walk_tree,
                                sparse_rejection, walk_tree)
from specdec.proposal import check_proposals
from specdec.model.batch import SeqInput, chunk_input, tree_input
from specdec.exit_heads import EarlyExit
from specdec.logprobs import TokenLogprob, token_logprobs
from specdec.model.native import PAGE_SIZE
from specdec.penalties import penalties_for
from specdec.model.runner import ModelRunner
from specdec.sampling import SamplingParams, greedy_rows, make_generator, sample_token, target_probs
from specdec.tree import DraftTree, TreeLimits


@dataclass
class Session:
    sid: str
    prefix: list[int]  # prompt + emitted tokens; prefix[-1] is the root
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    finished: bool = False
    finish_reason: str | None = None
    awaiting_resample: bool = False  # chain mode: the edge owes the resampled token
    residual_tail: torch.Tensor | None = None  # chain mode: [vocab] p's tail at the rejected position (refills)
    last_used: float = field(default_factory=time.monotonic)
    adapter: str | None = None  # target version (LoRA adapter); None: the base
    cache_salt: str | None = None  # who may share its cached KV (the tenant)

    @property
    def num_generated(self) -> int:
        return len(self.prefix) - self.prompt_len

    def penalties(self, vocab: int, device):
        """Penalties of its history now (None unless its params penalise)."""
        return penalties_for(self.params, self.prefix[: self.prompt_len], self.prefix[self.prompt_len:], vocab, device)


@dataclass(frozen=True)
class OpenRequest:
    sid: str
    prompt: list[int]
    params: SamplingParams
    generated: tuple[int, ...] = ()  # re-open: tokens the session already emitted
    adapter: str | None = None  # target version (deploy/verifier/adapters.py); None: the base
    cache_salt: str | None = None  # prefix caching: sessions share cached KV only within one salt (the tenant)


@dataclass(frozen=True)
class OpenResult:
    sid: str
    first_token: int | None  # None when re-opened from history
    prefix_len: int
    finished: bool
    finish_reason: str | None
    cached_tokens: int = 0  # of the prompt + history, taken from the prefix cache (not computed)
    first_logprob: TokenLogprob | None = None  # when the params ask for logprobs


@dataclass(frozen=True)
class VerifyRequest:
    sid: str
    tree: DraftTree
    prefix_len: int  # the prefix length the edge assumes (root included)
    limit: int | None = None  # verify only the first ``limit`` nodes (server-side truncation)
    early: bool = False  # stream early results (exit heads, specdec/exit_heads.py) to ``on_early``
    # tree rejection sampling: per position (root, then node i), the (ids, weights) its children
    # were drawn from without replacement (acceptance.py); such trees are never truncated
    proposals: tuple | None = None


@dataclass(frozen=True)
class VerifyResult:
    sid: str
    accepted: tuple[int, ...]  # node indices of the accepted path
    bonus: int | None  # None only if max_tokens/stop ended the session on an accepted node
    tokens: tuple[int, ...]  # emitted this round: accepted tokens (+ bonus)
    prefix_len: int  # after this round
    finished: bool
    finish_reason: str | None
    verified: int = 0  # nodes of the tree verified (all of them unless truncated)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per emitted token, when the params ask for them


@dataclass(frozen=True)
class ChainVerifyRequest:
    """DSSD-split rejection sampling: chain tokens with the draft's q(x) per token.

    ``more``: the edge used up a rejection's tail candidates before its residual sampler
    accepted one and asks for fresh ones (no tokens; ``prefix_len`` counts the owed
    token). Sent to a session that owes nothing (re-opened from history after it was
    lost), it asks for a rejection reply for the next position instead.
    """

    sid: str
    tokens: tuple[int, ...]
    q: tuple[float, ...]
    prefix_len: int
    resampled: int | None = None  # the residual sample owed after a rejection
    more: bool = False


@dataclass(frozen=True)
class ChainVerifyResult:
    """On rejection (``bonus`` None, not finished): the edge's :class:`~specdec.residual.Rejection`,
    head (``reject_top_*``: all of p when ``tail_mass`` is 0) and tail candidates."""

    sid: str
    num_accepted: int
    bonus: int | None  # None on rejection: the edge resamples from the residual
    reject_top_ids: tuple[int, ...] = ()
    reject_top_probs: tuple[float, ...] = ()
    prefix_len: int = 0
    finished: bool = False
    finish_reason: str | None = None
    tail_mass: float = 0.0
    tail_ids: tuple[int, ...] = ()
    tail_probs: tuple[float, ...] = ()

    @property
    def rejected(self) -> bool:
        return self.bonus is None and not self.finished

    @classmethod
    def of_rejection(cls, sid: str, num_accepted: int, rej, prefix_len: int) -> "ChainVerifyResult":
        return cls(sid, num_accepted, None, rej.head_ids, rej.head_probs, prefix_len, False, None,
                   rej.tail_mass, rej.tail_ids, rej.tail_probs)


@dataclass(frozen=True)
class ForwardStats:
    """One target forward, as observed by the engine (pacing and metrics read these)."""

    kind: str  # "prefill" | "verify" | "chain"
    sessions: int
    tokens: int  # new tokens in the batch (packed: no padding)
    seconds: float
    prefill_tokens: int = 0  # of which prompt tokens (a prefill chunk riding along a verify forward)
    # CPU time of the calling thread (on a CPU replica, seconds - cpu_seconds: the core was taken by
    # other processes; pipeline stages in other processes and GPU work are not in it)
    cpu_seconds: float = 0.0


@dataclass
class _Prefill:
    """A session being prefilled chunk by chunk."""

    session: Session
    feed: list[int]  # tokens that enter the KV (prompt, or a re-open's history[:-1])
    generated: tuple[int, ...]
    fed: int = 0
    looked_up: bool = False  # the prefix cache was asked (at the first chunk)
    cached: int = 0  # feed tokens found there


def _tree_item(s: Session, tree: DraftTree) -> SeqInput:
    """A session's root (``prefix[-1]``, at the KV's end) and its tree, as one forward input."""
    item = tree_input(s.sid, len(s.prefix) - 1, s.prefix[-1], tree.tokens, tree.parents, tree.depths)
    item.adapter = s.adapter
    return item


class VerifierEngine:
    def __init__(self, model, *, eos_token_ids=(), limits: TreeLimits = TreeLimits(),
                 max_model_len: int | None = None, runner=None, chain_top_k: int = 64,
                 on_forward=None, kv_capacity_tokens: int = 1 << 16, max_batch_tokens: int = 2048,
                 compile: bool = False, adapters=None, prefix_caching: bool = False):
        self.model = model
        self.adapters = adapters  # AdapterRegistry: LoRA target versions (None: the base only)
        self.runner = runner if runner is not None else ModelRunner(model, kv_capacity_tokens=kv_capacity_tokens,
                                                                    compile=compile, prefix_caching=prefix_caching)
        self.prefix_caching = prefix_caching  # (a runner passed in is built with the same setting)
        self.prefix_tokens = [0, 0]  # prompt tokens looked up in the prefix cache, and found there
        self.vocab_size = model.config.vocab_size
        self.max_batch_tokens = max_batch_tokens
        self.prefilling: OrderedDict[str, _Prefill] = OrderedDict()
        self.opened: list[OpenResult] = []  # completed by chunks inside verify forwards
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.limits = limits
        self.max_model_len = max_model_len or getattr(model.config, "max_position_embeddings", 1 << 16)
        self.chain_top_k = chain_top_k
        self.sessions: dict[str, Session] = {}
        self.on_forward = on_forward  # callback(ForwardStats)
        self._batch_ids = itertools.count()
        self.exit_heads = None  # ExitHeads: early results mid-forward for requests with ``early``
        self._on_layer = None  # the next forward's per-layer hook (exit heads)
        self.version_failures: dict[str, SpecError] = {}  # sessions closed as their version failed to load
        self._version_epoch: dict[str, int] = {}  # a re-pointed version's cached KV is never matched again

    # -- helpers ------------------------------------------------------------------
    def get(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise SessionNotFound(f"unknown session {sid!r}")
        return s

    def kv_tokens(self) -> int:
        """Committed KV tokens of all sessions."""
        return self.runner.kv_tokens()

    def kv_used_tokens(self) -> int:
        """KV pool capacity the sessions hold (whole pages)."""
        return self.runner.kv_used_tokens()

    def _check_ids(self, ids, what: str) -> None:
        for t in ids:
            if not (0 <= int(t) < self.vocab_size):
                raise InvalidRequest(f"{what}: token id {t} is outside the vocabulary [0, {self.vocab_size})")

    def _emit(self, s: Session, tokens: list[int]) -> None:
        """Append emitted tokens and update the finished state."""
        s.prefix.extend(tokens)
        if tokens and tokens[-1] in s.stop_ids:
            s.finished, s.finish_reason = True, "stop"
        elif s.num_generated >= s.params.max_tokens or len(s.prefix) >= self.max_model_len - 1:
            s.finished, s.finish_reason = True, "length"
        if s.finished:  # its KV is never needed again by it, maybe by later prompts
            if self.prefix_caching:
                self._cache(s)
            self.runner.drop(s.sid)

    def _remaining(self, s: Session) -> int:
        return min(s.params.max_tokens - s.num_generated, self.max_model_len - 1 - len(s.prefix))

    def _forward(self, kind: str, items: list[SeqInput], prefill_tokens: int = 0):
        bid = next(self._batch_ids)
        t0, c0 = time.perf_counter(), time.thread_time()
        versions = {it.adapter for it in items} - {None}
        if versions:  # loaded by _ready_versions already: this keeps them all for the forward
            failed = self.adapters.activate(versions)
            if failed:
                raise next(iter(failed.values()))
        try:
            hook, self._on_layer = self._on_layer, None
            logits = self.runner.forward(bid, items, **({"on_layer": hook} if hook is not None else {}))
        except BaseException:
            self.runner.abort(bid)
            raise
        finally:
            if versions:  # a forward that needed more than max_loaded versions held them all: trim back
                self.adapters.trim()
        dt = time.perf_counter() - t0
        if self.on_forward is not None:
            self.on_forward(ForwardStats(kind, len(items), sum(len(it.tokens) for it in items), dt,
                                         prefill_tokens if kind != "prefill" else 0, time.thread_time() - c0))
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

    # -- open / close -------------------------------------------------------------
    def open(self, requests: list[OpenRequest]) -> list[OpenResult | SpecError]:
        """Prefill new (or re-opened) sessions to the end; sample first tokens."""
        out: list[OpenResult | SpecError | None] = list(self.begin_open(requests))
        index = {r.sid: i for i, r in enumerate(requests) if out[i] is None}
        while any(sid in self.prefilling for sid in index):
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
                if r.sid in self.sessions or r.sid in self.prefilling:  # twice would share one KV
                    raise InvalidRequest(f"session {r.sid!r} already exists")
                if not r.prompt:
                    raise InvalidRequest("prompt must contain at least one token")
                self._check_ids(r.prompt, "prompt")
                self._check_ids(r.generated, "generated")
                params = r.params.validate(self.vocab_size)
                history = list(r.prompt) + list(r.generated)
                if len(history) + 1 >= self.max_model_len:
                    raise InvalidRequest(f"prompt + history of {len(history)} tokens exceeds the model "
                                         f"context of {self.max_model_len}")
                if len(r.generated) > params.max_tokens:
                    raise InvalidRequest("history is longer than max_tokens")
                stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
                self._check_version(r.adapter)
                # one uniform per emitted token: a re-open fast-forwards the generator
                s = Session(r.sid, list(r.prompt), len(r.prompt), params,
                            make_generator(params, skip=len(r.generated)), stop, adapter=r.adapter,
                            cache_salt=r.cache_salt)
                # a re-open feeds the KV with history[:-1]; its last token is the root
                feed = history if not r.generated else history[:-1]
                self.prefilling[r.sid] = _Prefill(s, feed, tuple(r.generated))
            except SpecError as e:
                out[i] = e
        return out

    def prefill_step(self, budget_tokens: int, only: set[str] | None = None) -> list[OpenResult]:
        """One forward over at most ``budget_tokens`` queued prompt tokens (first come, first
        served; ``only``: these sessions); returns the sessions whose prefill completed, with
        their first token."""
        items, chunks = self._prefill_items(budget_tokens, only)
        if self._ready_versions({p.session.adapter for p, _n, _d in chunks}):
            items, chunks = self._without_closed(items, chunks)
        if not items:
            return []
        bid, logits = self._forward_prefilling("prefill", items, chunks)
        self._commit(bid, self._prefill_keep(chunks))
        return self._finish_prefill(chunks, logits)

    def take_opened(self) -> list[OpenResult]:
        """Opens completed by prefill chunks that rode along with verify forwards."""
        out, self.opened = self.opened, []
        return out

    def _prefill_items(self, budget_tokens: int, only: set[str] | None = None):
        items, chunks = [], []
        left = budget_tokens
        for sid, p in list(self.prefilling.items()):
            if left <= 0:
                break
            if only is not None and sid not in only:
                continue
            if not p.looked_up and self.prefix_caching:  # computed at no cost: its prefix's cached pages
                p.looked_up = True
                p.fed = p.cached = self.runner.share_prefix(sid, p.feed, self._salt(p.session))
                self.prefix_tokens[0] += len(p.feed)
                self.prefix_tokens[1] += p.cached
            n = min(len(p.feed) - p.fed, left)
            done = p.fed + n == len(p.feed)
            items.append(chunk_input(sid, p.fed, p.feed[p.fed: p.fed + n], [n - 1] if done else []))
            items[-1].adapter = p.session.adapter
            chunks.append((p, n, done))
            left -= n
        return items, chunks

    def _forward_prefilling(self, kind: str, items: list[SeqInput], chunks):
        try:
            return self._forward(kind, items, sum(n for _p, n, _d in chunks))
        except SpecError:  # the pool is full: the sessions being prefilled fail, the rest goes on
            for p, _n, _done in chunks:
                self.prefilling.pop(p.session.sid, None)
                self.runner.drop(p.session.sid)
            raise

    def _prefill_keep(self, chunks) -> dict:
        return {p.session.sid: (n, []) for p, n, _ in chunks if p.session.sid in self.prefilling}

    def _finish_prefill(self, chunks, logits) -> list[OpenResult]:
        out = []
        for (p, n, done), lg in zip(chunks, logits):
            s = p.session
            if s.sid not in self.prefilling:  # closed while its chunk ran
                continue
            p.fed += n
            if self.prefix_caching and p.fed // PAGE_SIZE > (p.fed - n) // PAGE_SIZE:  # a new whole page
                self.runner.cache_prefix(s.sid, p.feed[: p.fed], self._salt(s))
            if not done:
                continue
            del self.prefilling[s.sid]
            self.sessions[s.sid] = s
            if p.generated:
                self._emit(s, list(p.generated))
                first = None
            else:
                pen = s.penalties(self.vocab_size, lg.device)
                first = sample_token(lg[0] if pen is None else pen.apply(lg[0]), s.params, s.generator)
                lp = token_logprobs(lg[:1], [first], s.params.logprobs)[0] if s.params.logprobs is not None else None
                self._emit(s, [first])
            out.append(OpenResult(s.sid, first, len(s.prefix), s.finished, s.finish_reason, p.cached,
                                  lp if not p.generated else None))
        return out

    def close(self, sid: str, cache: bool = True) -> None:
        """End a session; its committed KV is offered to later prompts unless ``cache`` is False
        (KV that may be out of step)."""
        s = self.sessions.pop(sid, None)
        if s is not None and cache and self.prefix_caching:
            self._cache(s)
        self.runner.drop(sid)
        self.prefilling.pop(sid, None)

    # -- prefix caching -----------------------------------------------------------------
    def _salt(self, s: Session) -> tuple:
        """Sessions share cached KV only with the same salt, target version and version epoch."""
        return s.cache_salt, s.adapter, self._version_epoch.get(s.adapter, 0)

    def _cache(self, s: Session) -> None:
        """Offer a session's committed KV (``prefix[:kv_length]``) to later prompts."""
        self.runner.cache_prefix(s.sid, s.prefix[: self.runner.kv_length(s.sid)], self._salt(s))

    def prefix_cache_stats(self) -> dict | None:
        """Prompt tokens looked up in the prefix cache and found there, and (a local runner) its
        pages cached and idle; None when prefix caching is off."""
        if not self.prefix_caching:
            return None
        return {"query_tokens": self.prefix_tokens[0], "hit_tokens": self.prefix_tokens[1],
                **(self.runner.prefix_stats() or {})}

    # -- target versions (LoRA adapters) ------------------------------------------------
    def _check_version(self, name: str | None) -> None:
        """404 ``model_not_found`` unless ``name`` is the base (None) or a served version."""
        if name is not None:
            if self.adapters is None:
                raise ModelNotFound(f"target version {name!r} is not served here (no versions configured)")
            self.adapters.check(name)

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

    def _without_closed(self, items: list[SeqInput], chunks):
        """Prefill items/chunks minus the sessions no longer prefilling."""
        keep = [j for j, (p, _n, _d) in enumerate(chunks) if p.session.sid in self.prefilling]
        return [items[j] for j in keep], [chunks[j] for j in keep]

    def drop_versions(self, names: set[str]) -> list[str]:
        """Close every session (live or prefilling) of these versions; their ids."""
        gone = [sid for sid, s in self.sessions.items() if s.adapter in names]
        gone += [sid for sid, p in self.prefilling.items() if p.session.adapter in names]
        for sid in gone:
            self.close(sid, cache=False)
        for name in names:  # a re-pointed version must not read the old one's cached KV
            self._version_epoch[name] = self._version_epoch.get(name, 0) + 1
        return gone

    # -- verify -------------------------------------------------------------------
    def _live(self, sid: str, prefix_len: int) -> Session:
        s = self.get(sid)
        if s.finished:
            raise SessionFinished(f"session {sid!r} is finished ({s.finish_reason})")
        self._check_version(s.adapter)
        if prefix_len != len(s.prefix):
            raise PrefixMismatch(f"request assumes a prefix of {prefix_len} tokens, the session has "
                                 f"{len(s.prefix)}", server_prefix_len=len(s.prefix))
        return s

    def verify(self, requests: list[VerifyRequest], prefill_tokens: int = 0,
               on_early=None) -> list[VerifyResult | SpecError]:
        """Verify the trees of many sessions in one target forward.

        Invalid requests get their error back and do not touch any session; the others
        are verified together. An empty tree is one plain decoding step. ``prefill_tokens``:
        up to that many queued prompt tokens ride along in the same forward (chunked
        prefill); opens they complete are collected by :meth:`take_opened`.
        """
        out: list[VerifyResult | SpecError | None] = [None] * len(requests)
        todo: list[tuple] = []  # (index, session, tree, kept node indices or None, nodes sent, proposals)
        seen = set()
        for i, r in enumerate(requests):
            try:
                if r.sid in seen:
                    raise InvalidRequest(f"session {r.sid!r} appears twice in one batch")
                s = self._live(r.sid, r.prefix_len)
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
                n_prefix = len(tree)
                # a node of depth d sits at position len(prefix) - 1 + d: near the end of the
                # context the deeper nodes are cut (the session then ends with "length")
                room = self.max_model_len - len(s.prefix)
                tree, kept = tree.clip(room) if tree.depth > room else (tree, None)
                if props is not None and kept is not None:  # the clip depends on depth only: still exact
                    props = (props[0],) + tuple(None if not tree.children[j + 1] else props[k + 1]
                                                for j, k in enumerate(kept))
                seen.add(r.sid)
                todo.append((i, s, tree, kept, n_prefix, props))
            except SpecError as e:
                out[i] = e
        if not todo:
            return out  # type: ignore[return-value]
        pre_items, chunks = self._prefill_items(prefill_tokens) if prefill_tokens > 0 else ([], [])
        failed = self._ready_versions({t[1].adapter for t in todo} | {p.session.adapter for p, _n, _d in chunks})
        if failed:  # a version that cannot be loaded fails its own sessions, not the batch
            for t in todo:
                if t[1].adapter in failed:
                    out[t[0]] = failed[t[1].adapter]
            todo = [t for t in todo if t[1].adapter not in failed]
            pre_items, chunks = self._without_closed(pre_items, chunks)
            if not todo:
                return out  # type: ignore[return-value]
        items = [_tree_item(s, tree) for _, s, tree, _kept, _n, _p in todo]
        if on_early is not None and self.exit_heads is not None:  # exit heads walk the trees mid-forward
            self._on_layer = EarlyExit.for_batch(self, requests, todo, on_early)
        bid, logits = self._forward_prefilling("verify", items + pre_items, chunks)
        logits, pre_logits = logits[: len(items)], logits[len(items):]
        keep = self._prefill_keep(chunks)
        walks = []
        # on a GPU, every row's argmax in one launch and one copy (not a launch and a sync per visited row)
        argmax = greedy_rows(logits) if logits and logits[0].is_cuda else [None] * len(logits)
        for (i, s, tree, kept, n_prefix, props), lg, top in zip(todo, logits, argmax):
            pen = s.penalties(self.vocab_size, lg.device)
            if props is None:
                acc = walk_tree(tree, lg, s.params, s.generator, max_emit=self._remaining(s), stop_ids=s.stop_ids,
                                penalties=pen, argmax=top)
            else:
                acc = rejection_walk_tree(tree, lg, props, s.params, s.generator, max_emit=self._remaining(s),
                                          stop_ids=s.stop_ids, penalties=pen)
            root = len(s.prefix) - 1  # node j was written at root + 1 + j
            keep[s.sid] = (1, [root + 1 + a for a in acc.accepted])  # the root and the accepted path
            # the reply names nodes of the tree the edge sent
            path = acc.accepted if kept is None else tuple(kept[a] for a in acc.accepted)
            emitted = [tree.tokens[a] for a in acc.accepted] + [acc.bonus]
            lps = None
            if s.params.logprobs is not None:  # row 0 emitted the first token, node a's row the one after it
                lps = token_logprobs(lg[[0] + [a + 1 for a in acc.accepted]], emitted, s.params.logprobs)
            walks.append((i, s, acc, path, emitted, n_prefix, lps))
        self._commit(bid, keep)  # before _emit, which drops the KV of sessions that finish
        self.opened += self._finish_prefill(chunks, pre_logits)
        for i, s, acc, path, emitted, verified, lps in walks:
            s.last_used = time.monotonic()
            self._emit(s, emitted)
            out[i] = VerifyResult(s.sid, path, acc.bonus, tuple(emitted), len(s.prefix), s.finished, s.finish_reason,
                                  verified, lps)
        return out  # type: ignore[return-value]

    def verify_chain(self, requests: list[ChainVerifyRequest]) -> list[ChainVerifyResult | SpecError]:
        """Chain drafts with rejection sampling (DSSD), batched like trees.

        A rejection's reply lets the edge sample the residual exactly
        (:mod:`specdec.acceptance`); when it sent only p's head and tail
        candidates, the session keeps p's tail until the resampled token arrives, so that
        ``more`` requests get fresh candidates without a forward.
        """
        out: list = [None] * len(requests)
        todo = []
        seen: set[str] = set()
        for i, r in enumerate(requests):
            try:
                if r.sid in seen:
                    raise InvalidRequest(f"session {r.sid!r} appears twice in one batch")
                s = self.get(r.sid)
                if s.finished:
                    raise SessionFinished(f"session {r.sid!r} is finished ({s.finish_reason})")
                if s.params.logprobs is not None:  # a rejection's token is the edge's sample: no target row for it
                    raise InvalidRequest("logprobs are served in tree mode only, not in chain mode")
                if r.more:
                    refill = self._chain_more(s, r)
                    seen.add(r.sid)
                    if refill is not None:
                        out[i] = refill
                    else:  # re-opened: p of the next position takes a forward of the root alone
                        todo.append((i, s, [], [], True))
                    continue
                if len(r.tokens) != len(r.q):
                    raise InvalidRequest("chain mode needs one q(x) per draft token")
                if any(not (0.0 < q <= 1.0) for q in r.q):
                    raise InvalidRequest("q(x) values must be in (0, 1]")
                # validate everything before the session changes (an invalid request leaves it intact)
                DraftTree.chain(r.tokens).validate(self.vocab_size, self.limits)
                if s.awaiting_resample:
                    if r.resampled is None:
                        raise InvalidRequest("the previous round was rejected: send the resampled token")
                    self._check_ids([r.resampled], "resampled")
                    if r.prefix_len != len(s.prefix) + 1:
                        raise PrefixMismatch(f"request assumes a prefix of {r.prefix_len} tokens, expected "
                                             f"{len(s.prefix) + 1}", server_prefix_len=len(s.prefix) + 1)
                    seen.add(r.sid)
                    s.awaiting_resample, s.residual_tail = False, None
                    self._emit(s, [int(r.resampled)])
                    if s.finished:
                        out[i] = ChainVerifyResult(s.sid, 0, None, prefix_len=len(s.prefix), finished=True,
                                                   finish_reason=s.finish_reason)
                        continue
                else:
                    if r.resampled is not None:
                        raise InvalidRequest("no rejected round is pending: resampled must be absent")
                    self._live(r.sid, r.prefix_len)
                    seen.add(r.sid)
                tree = DraftTree.chain(r.tokens)
                k = min(len(tree), self._remaining(s) - 1)  # accepted + bonus within max_tokens
                todo.append((i, s, list(tree.tokens[:k]), list(r.q[:k]), False))
            except SpecError as e:
                out[i] = e
        failed = self._ready_versions({t[1].adapter for t in todo})
        for t in todo:
            if t[1].adapter in failed:
                out[t[0]] = failed[t[1].adapter]
        todo = [t for t in todo if t[1].adapter not in failed]
        if not todo:
            return out
        items = []
        for _, s, toks, _q, _more in todo:
            items.append(_tree_item(s, DraftTree.chain(toks)))
        bid, logits = self._forward("chain", items)
        keep = {}
        results = []
        for (i, s, toks, q, more), lg in zip(todo, logits):
            pen = s.penalties(self.vocab_size, lg.device)
            if more:  # the edge's rejection state was lost with the session: a whole new one
                row = lg[0] if pen is None else pen.apply(lg[0])
                rej, tail = sparse_rejection(target_probs(row, s.params).cpu(), 0.0, self.chain_top_k, s.generator)
                acc = ChainAcceptance(0, None, rej, tail)
            else:
                acc = rejection_sample_chain(toks, q, lg, s.params, s.generator, self.chain_top_k, penalties=pen)
            accepted = toks[: acc.num_accepted]
            cut = next((j for j, t in enumerate(accepted) if t in s.stop_ids), None)
            if cut is not None:  # a stop token among the accepted ends the session there
                accepted, acc = accepted[: cut + 1], ChainAcceptance(cut + 1, None)
            keep[s.sid] = (1 + len(accepted), [])  # a chain's accepted nodes follow the root in place
            results.append((i, s, acc, accepted))
        self._commit(bid, keep)
        for i, s, acc, accepted in results:
            s.last_used = time.monotonic()
            emitted = accepted + ([acc.bonus] if acc.bonus is not None else [])
            self._emit(s, emitted)
            if acc.bonus is None and not s.finished:
                s.awaiting_resample, s.residual_tail = True, acc.tail
                out[i] = ChainVerifyResult.of_rejection(s.sid, acc.num_accepted, acc.rejection, len(s.prefix) + 1)
            else:
                out[i] = ChainVerifyResult(s.sid, acc.num_accepted, acc.bonus, prefix_len=len(s.prefix),
                                           finished=s.finished, finish_reason=s.finish_reason)
        return out

    def _chain_more(self, s: Session, r: ChainVerifyRequest) -> ChainVerifyResult | None:
        """A ``more`` request: fresh tail candidates of the pending rejection, or None when the
        session owes nothing (re-opened) and the next position needs a forward."""
        if s.params.greedy:
            raise InvalidRequest("a greedy session never resamples: nothing more to send")
        if r.tokens or r.q or r.resampled is not None:
            raise InvalidRequest("a request for more residual candidates carries no tokens")
        if r.prefix_len != len(s.prefix) + 1:  # the owed token's slot counts
            raise PrefixMismatch(f"request assumes a prefix of {r.prefix_len} tokens with the owed token, "
                                 f"expected {len(s.prefix) + 1}", server_prefix_len=len(s.prefix) + s.awaiting_resample)
        if not s.awaiting_resample:
            self._live(s.sid, len(s.prefix))
            return None
        if s.residual_tail is None:
            raise InvalidRequest("the rejection carried all of p: the edge needs nothing more")
        s.last_used = time.monotonic()
        rej = more_candidates(s.residual_tail, self.chain_top_k, s.generator)
        return ChainVerifyResult.of_rejection(s.sid, 0, rej, len(s.prefix) + 1)
