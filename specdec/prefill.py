"""Chunked, token-budgeted prefill of new and re-opened sessions: the engine's prefill queue.

:func:`admit_open` validates an open request into a :class:`PrefillState`; a :class:`PrefillQueue`
holds those states, first come first served, and cuts at most a budget of prompt tokens from them
per forward (:meth:`PrefillQueue.take`), so a long prompt never holds up other sessions' verify
rounds. The engine packs the chunks into a prefill forward or a verify forward and hands their
logits back (:meth:`PrefillQueue.finish`). With prefix caching a prompt's first chunk starts on the
cached KV pages of its longest cached prefix (:mod:`specdec.model.prefix_cache`), and a session's
whole pages are offered to later prompts as its prefill proceeds. Batch invariance makes chunking
and caching exact: a first token is the one prefilling the prompt at once would give
(``docs/engine.md``, "Batch invariance").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from specdec import clock
from specdec.engine_types import OpenRequest, OpenResult, Session, check_ids
from specdec.errors import InvalidRequest
from specdec.logprobs import token_logprobs
from specdec.model.batch import SeqInput, chunk_input
from specdec.model.native import PAGE_SIZE
from specdec.sampling import make_generator, sample_token
from specdec.session_table import SessionTable
from specdec.tree import DraftTree


@dataclass
class PrefillState:
    """A session being prefilled chunk by chunk."""

    session: Session
    feed: list[int]  # tokens that enter the KV (prompt, or a re-open's history[:-1])
    generated: tuple[int, ...]
    fed: int = 0
    looked_up: bool = False  # the prefix cache was asked (at the first chunk)
    started: bool = False  # a chunk was taken (the open's wait for its prefill is over)
    start_by: float | None = None  # monotonic time: dropped if still waiting behind another prompt then
    cached: int = 0  # feed tokens found there


@dataclass
class PrefillChunk:
    """The next ``n`` feed tokens of one prefilling session, as one forward input."""

    state: PrefillState
    item: SeqInput  # feed[fed: fed + n]; one logit row (the last) when ``done``
    n: int
    done: bool  # the chunk ends the feed: its row samples the first token


def admit_open(r: OpenRequest, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int]) -> PrefillState:
    """Validate an open request (raising :class:`~specdec.errors.InvalidRequest`) into the
    state of its prefill; its target version and session id are the engine's to check."""
    if not r.prompt:
        raise InvalidRequest("prompt must contain at least one token")
    check_ids(r.prompt, vocab_size, "prompt")
    check_ids(r.generated, vocab_size, "generated")
    params = r.params.validate(vocab_size)
    history = list(r.prompt) + list(r.generated)
    if len(history) + 1 >= max_model_len:
        raise InvalidRequest(f"prompt + history of {len(history)} tokens exceeds the model "
                             f"context of {max_model_len}")
    if len(r.generated) > params.max_tokens:
        raise InvalidRequest("history is longer than max_tokens")
    if r.grammar is not None and not r.grammar.allows(r.generated):
        raise InvalidRequest("history does not follow the request's grammar")
    stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
    # one uniform per emitted token: a re-open fast-forwards the generator
    s = Session(r.sid, list(r.prompt), len(r.prompt), params, make_generator(params, skip=len(r.generated)),
                stop, adapter=r.adapter, cache_salt=r.cache_salt, grammar=r.grammar)
    # a re-open feeds the KV with history[:-1]; its last token is the root
    feed = history if not r.generated else history[:-1]
    return PrefillState(s, feed, tuple(r.generated), start_by=r.start_by)


class PrefillQueue:
    """The sessions being prefilled and the chunks cut from them.

    State: :attr:`prefilling` (sid -> :class:`PrefillState`, in arrival order), :attr:`opened`
    (opens completed by chunks that rode along with verify forwards, until :meth:`take_opened`),
    :attr:`prefix_tokens` (prompt tokens looked up in the prefix cache, and found there). It runs
    no forward: the engine packs the chunks of :meth:`take` into its forward, commits their KV
    (:meth:`keep`) and hands their logits to :meth:`finish`, which moves each completed session
    into the engine's :class:`~specdec.session_table.SessionTable` and samples its first token."""

    def __init__(self, table: SessionTable, *, vocab_size: int):
        self.table = table  # the engine's sessions: a completed prefill moves there
        self.runner = table.runner  # its KV pool: prefix-cache lookups and offers, drops
        self.vocab_size = vocab_size
        self.prefix_caching = table.prefix_caching
        self.prefilling: OrderedDict[str, PrefillState] = OrderedDict()
        self.opened: list[OpenResult] = []
        self.late: list[str] = []  # dropped past their start_by, until take_late
        self.prefix_tokens = [0, 0]

    def __contains__(self, sid: str) -> bool:
        return sid in self.prefilling

    def add(self, state: PrefillState) -> None:
        """Queue a session (admitted by :func:`admit_open`) behind the others."""
        self.prefilling[state.session.sid] = state

    def discard(self, sid: str) -> None:
        """Forget a session (closed); its chunks in flight are then skipped."""
        self.prefilling.pop(sid, None)

    def take(self, budget_tokens: int, only: set[str] | None = None) -> list[PrefillChunk]:
        """The next chunks, first come first served, of at most ``budget_tokens`` feed tokens in
        all (``only``: of these sessions). A session's first chunk starts after the feed tokens
        found in the prefix cache."""
        self._drop_late()
        chunks = []
        left = budget_tokens
        for sid, p in list(self.prefilling.items()):
            if left <= 0:
                break
            if only is not None and sid not in only:
                continue
            if not p.looked_up and self.prefix_caching:  # computed at no cost: its prefix's cached pages
                p.looked_up = True
                p.fed = p.cached = self.runner.share_prefix(sid, p.feed, self.table.salt(p.session))
                self.prefix_tokens[0] += len(p.feed)
                self.prefix_tokens[1] += p.cached
            n = min(len(p.feed) - p.fed, left)
            done = p.fed + n == len(p.feed)
            item = chunk_input(sid, p.fed, p.feed[p.fed: p.fed + n], [n - 1] if done else [])
            item.adapter = p.session.adapter
            chunks.append(PrefillChunk(p, item, n, done))
            p.started = True
            left -= n
        return chunks

    def still_queued(self, chunks: list[PrefillChunk]) -> list[PrefillChunk]:
        """The chunks of sessions still prefilling (not closed since :meth:`take`)."""
        return [c for c in chunks if c.state.session.sid in self.prefilling]

    def fail(self, chunks: list[PrefillChunk]) -> None:
        """Their forward failed (the pool is full): these sessions fail, their KV is dropped."""
        for c in chunks:
            self.prefilling.pop(c.state.session.sid, None)
            self.runner.drop(c.state.session.sid)

    def keep(self, chunks: list[PrefillChunk]) -> dict:
        """The KV commit of the chunks: each session keeps its ``n`` new positions."""
        return {c.state.session.sid: (c.n, []) for c in chunks if c.state.session.sid in self.prefilling}

    def finish(self, chunks: list[PrefillChunk], logits: list[torch.Tensor], hold: bool = False) -> list[OpenResult]:
        """Advance the chunks' sessions after their forward (``logits``: one [1 or 0, vocab] per
        chunk); a completed session moves to the session table with its first token. Returns the
        completed opens, or keeps them for :meth:`take_opened` when ``hold`` (a verify forward's)."""
        out = []
        for c, lg in zip(chunks, logits):
            p, n, s = c.state, c.n, c.state.session
            if s.sid not in self.prefilling:  # closed while its chunk ran
                continue
            p.fed += n
            if self.prefix_caching and p.fed // PAGE_SIZE > (p.fed - n) // PAGE_SIZE:  # a new whole page
                self.runner.cache_prefix(s.sid, p.feed[: p.fed], self.table.salt(s))
            if c.done:
                del self.prefilling[s.sid]
                self.table.sessions[s.sid] = s
                out.append(self._first_token(p, lg))
        if hold:
            self.opened += out
            return []
        return out

    def _first_token(self, p: PrefillState, lg: torch.Tensor) -> OpenResult:
        """Sample a prefilled session's first token from its row (``lg`` [1, vocab]); a re-open
        emits its history instead."""
        s = p.session
        if p.generated:
            self.table.emit(s, list(p.generated))
            first = lp = None
        else:
            if s.grammar is not None:
                lg = s.grammar.apply(lg, DraftTree.empty())
            pen = s.penalties(self.vocab_size, lg.device)
            first = sample_token(lg[0] if pen is None else pen.apply(lg[0]), s.params, s.generator)
            lp = token_logprobs(lg[:1], [first], s.params.logprobs)[0] if s.params.logprobs is not None else None
            self.table.emit(s, [first])
        return OpenResult(s.sid, first, len(s.prefix), s.finished, s.finish_reason, p.cached, lp)

    def _drop_late(self) -> None:
        """Drop the sessions past their ``start_by`` still waiting behind another one for their
        first chunk (nothing computed for them yet), into :attr:`late`. The first in the queue is
        never dropped: it starts with this forward, whatever it waited for."""
        now = clock.monotonic()
        head = next(iter(self.prefilling), None)
        for sid, p in list(self.prefilling.items()):
            if sid != head and not p.started and p.start_by is not None and p.start_by <= now:
                del self.prefilling[sid]
                self.runner.drop(sid)
                self.late.append(sid)

    def take_late(self) -> list[str]:
        """Sessions dropped for their ``start_by`` since the last call."""
        out, self.late = self.late, []
        return out

    def take_opened(self) -> list[OpenResult]:
        """Opens completed by chunks that rode along with verify forwards."""
        out, self.opened = self.opened, []
        return out
