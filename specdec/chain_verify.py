"""Chain verification: DSSD's split rejection sampling, batched (the engine's chain verifier).

The edge sends chain drafts with the draft's q(x) of each token (:class:`ChainVerifyRequest`);
one target forward verifies many sessions' chains and the server accepts x_i w.p.
min(1, p(x_i) / q(x_i)) (:func:`specdec.acceptance.rejection_sample_chain`; DSSD §3, PicoSpec
§3.3). On a rejection the reply carries p's head and tail candidates and the edge samples the
residual (:mod:`specdec.residual`) and sends that token with its next request; the session keeps
p's tail meanwhile, so ``more`` requests get fresh candidates without a forward. Guarantee: the
emitted tokens follow the target's distribution (greedy: its argmax); ``docs/acceptance.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import clock
from specdec.acceptance import ChainAcceptance, more_candidates, rejection_sample_chain, sparse_rejection
from specdec.engine_types import ChainVerifyRequest, ChainVerifyResult, Session, admit_batch, check_ids, tree_item
from specdec.errors import InvalidRequest, PrefixMismatch, SessionFinished
from specdec.model.batch import SeqInput
from specdec.sampling import target_probs
from specdec.session_table import SessionTable
from specdec.tree import DraftTree, TreeLimits


@dataclass
class ChainJob:
    """One admitted request of a chain batch."""

    index: int  # of the request in the batch
    session: Session
    tokens: list[int]  # the draft tokens verified (cut to what max_tokens leaves room for)
    q: list[float]  # q(x) of each
    fresh: bool = False  # a whole new rejection of the next position (the session was re-opened)


class ChainVerifier:
    """DSSD's rules for chain requests: :meth:`admit` a batch, :meth:`walk` each job's rows,
    :meth:`reply`. The engine runs the forward and commits the KV in between; the sessions (and
    a rejection's pending state, ``Session.awaiting_resample`` and ``residual_tail``) are its
    :class:`~specdec.session_table.SessionTable`'s."""

    def __init__(self, table: SessionTable, *, vocab_size: int, limits: TreeLimits, top_k: int):
        self.table = table
        self.vocab_size = vocab_size
        self.limits = limits  # a chain is validated as a tree
        self.top_k = top_k  # head and tail candidates of a rejection's reply

    def admit(self, requests: list[ChainVerifyRequest]) -> tuple[list, list[ChainJob]]:
        """Per request, its error, its result (answered without a forward), or None for a job;
        and the jobs for the forward. An invalid request leaves its session intact."""
        return admit_batch(requests, self._admit_one, ChainJob)

    @staticmethod
    def item(job: ChainJob) -> SeqInput:
        """The job's forward input: the session's root and its chain."""
        return tree_item(job.session, DraftTree.chain(job.tokens))

    def _admit_one(self, i: int, r: ChainVerifyRequest) -> ChainJob | ChainVerifyResult:
        """Validate a request (raising its error) and apply an owed resampled token; a job for
        the forward, or the result when none is needed."""
        s = self.table.get(r.sid)
        if s.finished:
            raise SessionFinished(f"session {r.sid!r} is finished ({s.finish_reason})")
        if s.params.logprobs is not None:  # a rejection's token is the edge's sample: no target row for it
            raise InvalidRequest("logprobs are served in tree mode only, not in chain mode")
        if r.more:
            refill = self._more(s, r)
            # re-opened: p of the next position takes a forward of the root alone
            return refill if refill is not None else ChainJob(i, s, [], [], fresh=True)
        if len(r.tokens) != len(r.q):
            raise InvalidRequest("chain mode needs one q(x) per draft token")
        if any(not (0.0 < q <= 1.0) for q in r.q):
            raise InvalidRequest("q(x) values must be in (0, 1]")
        # validate everything before the session changes (an invalid request leaves it intact)
        DraftTree.chain(r.tokens).validate(self.vocab_size, self.limits)
        if s.awaiting_resample:
            if r.resampled is None:
                raise InvalidRequest("the previous round was rejected: send the resampled token")
            check_ids([r.resampled], self.vocab_size, "resampled")
            if s.grammar is not None and not s.grammar.allows([r.resampled]):
                raise InvalidRequest("the resampled token does not follow the session's grammar")
            if r.prefix_len != len(s.prefix) + 1:
                raise PrefixMismatch(f"request assumes a prefix of {r.prefix_len} tokens, expected "
                                     f"{len(s.prefix) + 1}", server_prefix_len=len(s.prefix) + 1)
            s.awaiting_resample, s.residual_tail = False, None
            self.table.emit(s, [int(r.resampled)])
            if s.finished:
                return ChainVerifyResult(s.sid, 0, None, prefix_len=len(s.prefix), finished=True,
                                         finish_reason=s.finish_reason)
        else:
            if r.resampled is not None:
                raise InvalidRequest("no rejected round is pending: resampled must be absent")
            self.table.live(r.sid, r.prefix_len)
        tokens = DraftTree.chain(r.tokens).tokens  # as ints
        k = min(len(tokens), self.table.remaining(s) - 1)  # accepted + bonus within max_tokens
        return ChainJob(i, s, list(tokens[:k]), list(r.q[:k]))

    def walk(self, job: ChainJob, logits: torch.Tensor) -> tuple[ChainAcceptance, list[int]]:
        """Rejection-sample a job's chain with its rows (``logits`` [k + 1, vocab]): the
        acceptance and the accepted tokens (cut after a stop token)."""
        s = job.session
        if s.grammar is not None:
            logits = s.grammar.apply(logits, DraftTree.chain(job.tokens))
        pen = s.penalties(self.vocab_size, logits.device)
        if job.fresh:  # the edge's rejection state was lost with the session: a whole new one
            row = logits[0] if pen is None else pen.apply(logits[0])
            rej, tail = sparse_rejection(target_probs(row, s.params).cpu(), 0.0, self.top_k, s.generator)
            acc = ChainAcceptance(0, None, rej, tail)
        else:
            acc = rejection_sample_chain(job.tokens, job.q, logits, s.params, s.generator, self.top_k,
                                         penalties=pen)
        accepted = job.tokens[: acc.num_accepted]
        cut = next((j for j, t in enumerate(accepted) if t in s.stop_ids), None)
        if cut is not None:  # a stop token among the accepted ends the session there
            accepted, acc = accepted[: cut + 1], ChainAcceptance(cut + 1, None)
        return acc, accepted

    def reply(self, s: Session, acc: ChainAcceptance, accepted: list[int]) -> ChainVerifyResult:
        """Emit a walked chain's tokens; on a rejection the session then owes the resampled token."""
        s.last_used = clock.monotonic()
        self.table.emit(s, accepted + ([acc.bonus] if acc.bonus is not None else []))
        if acc.bonus is None and not s.finished:
            s.awaiting_resample, s.residual_tail = True, acc.tail
            return ChainVerifyResult.of_rejection(s.sid, acc.num_accepted, acc.rejection, len(s.prefix) + 1)
        return ChainVerifyResult(s.sid, acc.num_accepted, acc.bonus, prefix_len=len(s.prefix),
                                 finished=s.finished, finish_reason=s.finish_reason)

    def _more(self, s: Session, r: ChainVerifyRequest) -> ChainVerifyResult | None:
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
            self.table.live(s.sid, len(s.prefix))
            return None
        if s.residual_tail is None:
            raise InvalidRequest("the rejection carried all of p: the edge needs nothing more")
        s.last_used = clock.monotonic()
        rej = more_candidates(s.residual_tail, self.top_k, s.generator)
        return ChainVerifyResult.of_rejection(s.sid, 0, rej, len(s.prefix) + 1)
