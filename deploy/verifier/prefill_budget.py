"""How many prompt tokens a forward takes, from the replica's measured costs (SpecEdge §4.3).

New sessions are prefilled in chunks that ride along the verify forwards: a chunk adds at most
``verifier.prefill_share`` of its forward's predicted time per session waiting to be prefilled
(at least :data:`MIN_PREFILL_CHUNK`, at most ``verifier.prefill_chunk_tokens``), so a long prompt
never stalls the sessions decoding, and a burst of opens joins the batch together rather than one by
one. A forward of detached run-ahead steps alone waits on nobody and takes what fits before the
first edge is due back. Costs: an EMA of verify forwards until the cost curve
(:class:`deploy.verifier.pacing.PiecewiseCost`) has seen a few, and an EMA of what a prompt token
added to its forward (a prefill forward's tokens net of a one-row forward's cost). Pure module: no Ray, no asyncio.
"""

from __future__ import annotations


from deploy.config import VerifierConfig
from deploy.verifier.batch_fill import ArrivalModel
from deploy.verifier.forward_cost import PiecewiseCost
from deploy.verifier.scheduler import Pending
from specdec import clock
from specdec.engine import ForwardStats

MIN_PREFILL_CHUNK = 4  # prompt tokens per chunk riding along a verify forward, at least


def _ema(avg: float, x: float, weight: float) -> float:
    """Exponential moving average; the first observation (avg == 0) starts it."""
    return x if not avg else (1 - weight) * avg + weight * x


class PrefillBudget:
    """The measured costs and the prompt-token budgets of one replica's forwards."""

    def __init__(self, cfg: VerifierConfig, cost: PiecewiseCost):
        self.cfg, self.cost = cfg, cost
        self.verify_s = 0.0  # EMA of a verify forward's seconds (forwards without a chunk)
        self.token_s = 0.0  # EMA of the seconds a prompt token adds to a forward

    def observe(self, st: ForwardStats) -> None:
        """A forward ran: a prefill forward's time per token, a chunk's time beyond the cost
        curve's for its forward's verify rows, or a plain verify forward's time. Call before the
        cost curve sees it."""
        if st.kind == "prefill":  # less what a one-row forward costs anyway (the weights read): else small
            # chunks read dear per token, which shrinks the next chunks (found in simulation, issue 61)
            base = self.verify_forward_s(1) if self.verify_s else 0.0
            self.token_s = _ema(self.token_s, max(st.seconds - base, 0.1 * st.seconds) / max(st.tokens, 1), 0.3)
        elif st.prefill_tokens and self._measured():  # what the chunk added to a verify forward of its rows
            extra = max(st.seconds - self.verify_forward_s(st.tokens - st.prefill_tokens), 0.0) / st.prefill_tokens
            self.token_s = _ema(self.token_s, extra, 0.3)
        elif not st.prefill_tokens:
            self.verify_s = _ema(self.verify_s, st.seconds, 0.2)

    def _measured(self) -> bool:
        """Whether a verify forward's time is known: from the cost curve, or from chunkless forwards
        (under a steady backlog of opens every forward carries a chunk: the curve alone knows)."""
        return self.cost.count >= 3 or bool(self.verify_s)

    def verify_forward_s(self, rows: int) -> float:
        """Predicted seconds of a verify forward of ``rows`` rows: the cost curve once it has
        seen a few forwards, the EMA of verify forwards before that."""
        return self.cost.predict(rows) if self.cost.count >= 3 else self.verify_s

    def budget(self, waiting: int, rows: int | None = None) -> int:
        """Prompt tokens to add to a verify forward of ``rows`` rows (None: a typical one) while
        ``waiting`` sessions wait to be prefilled. Both sides are of the forward at hand: the
        EMA of small forwards would charge a big batch's own growth to its chunk."""
        vc = self.cfg
        if not (self._measured() and self.token_s):
            return min(vc.prefill_chunk_tokens, 16)
        if rows is not None:
            verify_s = self.verify_forward_s(rows)
        else:  # a typical forward: the EMA of chunkless ones, or (every forward carried a chunk) the curve's smallest
            verify_s = self.verify_s or self.verify_forward_s(1)
        fit = int(vc.prefill_share * max(waiting, 1) * verify_s / self.token_s)
        # a chunk also has a fixed cost (its rows read the prompt's whole KV so far): at least
        # MIN_PREFILL_CHUNK tokens, or tiny chunks would pay it over and over for little progress
        return max(min(MIN_PREFILL_CHUNK, vc.prefill_chunk_tokens), min(vc.prefill_chunk_tokens, fit))

    def chunk(self, batch: list[Pending], waiting: int, arrivals: ArrivalModel) -> int:
        """Prompt tokens to add to the forward of ``batch``: :meth:`budget`, or, when the batch is
        detached run-ahead steps alone (nobody waits on this forward), as many as fit before the
        first edge is due back (``arrivals``; a session with no round trip measured yet is not
        counted), up to ``verifier.max_batch_tokens``."""
        rows = sum(p.tokens for p in batch)
        paced = self.budget(waiting, rows)
        if any(p.payload.run is None or p.payload.run.fut is not None for p in batch) or not self.token_s:
            return paced
        most = self.cfg.max_batch_tokens
        due = arrivals.due(clock.monotonic(), set(), limit=1)
        fit = int((due[0] - self.verify_forward_s(rows)) / self.token_s) if due else most
        return max(paced, min(most, fit))
