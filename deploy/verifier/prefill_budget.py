"""How many prompt tokens a forward takes, from the replica's measured costs (SpecEdge §4.3).

At most ``verifier.prefill_share`` of a forward's time per session waiting (docs/verifier.md, "The batch loop")."""

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
        """A forward ran: update the prompt-token or verify-forward cost (call before the cost curve sees it)."""
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
        """Whether a verify forward's time is known: from the cost curve, or from chunkless forwards."""
        return self.cost.count >= 3 or bool(self.verify_s)

    def verify_forward_s(self, rows: int) -> float:
        """Predicted seconds of a verify forward of ``rows`` rows (the cost curve once it has seen 3)."""
        return self.cost.predict(rows) if self.cost.count >= 3 else self.verify_s

    def budget(self, waiting: int, rows: int | None = None) -> int:
        """Prompt tokens to add to a verify forward of ``rows`` rows (None: typical) while ``waiting`` sessions wait."""
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
        """Prompt tokens to add to the forward of ``batch``: :meth:`budget`, or for detached run-ahead steps alone
        as many as fit before the first edge is due back (``arrivals``), up to ``verifier.max_batch_tokens``."""
        rows = sum(p.tokens for p in batch)
        paced = self.budget(waiting, rows)
        if any(p.payload.run is None or p.payload.run.fut is not None for p in batch) or not self.token_s:
            return paced
        most = self.cfg.max_batch_tokens
        due = arrivals.due(clock.monotonic(), set(), limit=1)
        fit = int((due[0] - self.verify_forward_s(rows)) / self.token_s) if due else most
        return max(paced, min(most, fit))
