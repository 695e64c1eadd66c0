"""Chunked, token-budgeted prefill of new and re-opened sessions (part of :class:`specdec.engine.VerifierEngine`).

:meth:`Prefilling.begin_open` validates and queues sessions; :meth:`Prefilling.prefill_step` runs
one forward over at most a budget of queued prompt tokens, so a long prompt never holds up other
sessions' verify rounds (a verify forward can carry a chunk too: ``prefill_tokens``);
:meth:`Prefilling.open` runs a queue to the end. With prefix caching a prompt's first chunk
starts on the cached KV pages of its longest cached prefix (:mod:`specdec.model.prefix_cache`),
and a session's whole pages are offered to later prompts as its prefill proceeds.
Batch invariance makes chunking and caching exact: a first token is the one prefilling the
prompt at once would give (``docs/engine.md``, "Batch invariance").
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.engine_types import OpenRequest, OpenResult, Session
from specdec.errors import InvalidRequest, SpecError
from specdec.logprobs import token_logprobs
from specdec.model.batch import SeqInput, chunk_input
from specdec.model.native import PAGE_SIZE
from specdec.sampling import make_generator, sample_token


@dataclass
class PrefillState:
    """A session being prefilled chunk by chunk."""

    session: Session
    feed: list[int]  # tokens that enter the KV (prompt, or a re-open's history[:-1])
    generated: tuple[int, ...]
    fed: int = 0
    looked_up: bool = False  # the prefix cache was asked (at the first chunk)
    cached: int = 0  # feed tokens found there


class Prefilling:
    """The prefill half of :class:`~specdec.engine.VerifierEngine` (a mixin: its state --
    ``prefilling``, ``opened``, ``prefix_tokens`` -- and helpers -- ``_forward``, ``_commit``,
    ``_emit``, ``_ready_versions``, ``_salt`` -- are the engine's)."""

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
                self.prefilling[r.sid] = PrefillState(s, feed, tuple(r.generated))
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

    def _without_closed(self, items: list[SeqInput], chunks):
        """Prefill items/chunks minus the sessions no longer prefilling."""
        keep = [j for j, (p, _n, _d) in enumerate(chunks) if p.session.sid in self.prefilling]
        return [items[j] for j in keep], [chunks[j] for j in keep]
