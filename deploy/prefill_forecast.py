"""Time-to-first-token admission for opens (issue 67; why it is built so: docs/router.md, "The open deadline").

An open is refused (429) only when the prefill queued ahead of it is predicted past its deadline. Pure module."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec import clock
from specdec.errors import Overloaded

MIN_ROBUST_SAMPLES = 3  # below this, the cheapest sample stands in for the fit


@dataclass(frozen=True)
class OpenSample:
    """One answered open: the queue it waited for, its own prompt included, and how long it took."""

    opens: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class QueuedOpen:
    """An admitted open's ticket (:meth:`PrefillForecast.started`): the queue ahead of its first token, and when."""

    prompt_tokens: int
    opens: int
    tokens: int
    at: float


@dataclass
class PrefillCost:
    """Seconds to answer a queue of opens: ``fixed * opens + per_token * tokens``, both >= 0,
    fitted over the latest ``window`` samples when next asked (not on every answered open)."""

    window: int = 32
    samples: deque = field(default_factory=deque)  # OpenSample, oldest first
    _fit: tuple[float, float] | None = (0.0, 0.0)  # None: samples changed since the last fit

    def observe(self, s: OpenSample) -> None:
        self.samples.append(s)
        while len(self.samples) > self.window:
            self.samples.popleft()
        self._fit = None

    def coefficients(self) -> tuple[float, float]:
        """(fixed, per_token)."""
        if self._fit is None:
            self._fit = fit_cost(list(self.samples))
        return self._fit

    @property
    def fixed(self) -> float:
        return self.coefficients()[0]

    @property
    def per_token(self) -> float:
        return self.coefficients()[1]

    def predict(self, opens: int, tokens: int) -> float:
        fixed, per_token = self.coefficients()
        return fixed * opens + per_token * tokens

    @property
    def known(self) -> bool:
        return bool(self.samples)


def fit_cost(samples: list[OpenSample]) -> tuple[float, float]:
    """(fixed, per_token) of ``seconds = fixed * opens + per_token * tokens`` over ``samples``.
    Theil-Sen per open; below :data:`MIN_ROBUST_SAMPLES`, the cheapest sample's line."""
    pts = sorted(((s.tokens / s.opens, s.seconds / s.opens) for s in samples if s.opens > 0 and s.seconds > 0))
    if not pts:
        return 0.0, 0.0
    if len(pts) < MIN_ROBUST_SAMPLES:
        (x0, y0), (x1, y1) = pts[0], pts[-1]
        slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
        return max(0.0, min(y - slope * x for x, y in pts)), slope
    slopes = [(yj - yi) / (xj - xi) for i, (xi, yi) in enumerate(pts) for xj, yj in pts[i + 1:] if xj - xi >= 1.0]
    slope = max(0.0, statistics.median(slopes)) if slopes else 0.0
    return max(0.0, statistics.median(y - slope * x for x, y in pts)), slope


@dataclass
class PrefillForecast:
    """The opens admitted and not yet answered, and the predicted wait of the next one."""

    retry_after_s: float = 1.0
    clock: Callable[[], float] = clock.monotonic
    cost: PrefillCost = field(default_factory=PrefillCost)
    queued_opens: int = 0
    queued_tokens: int = 0  # prompt tokens of admitted opens not yet answered
    shed: int = 0
    probes: int = 0  # opens admitted past the forecast because none was admitted for retry_after_s
    _last_admitted: float = float("-inf")

    def predicted_wait(self) -> float:
        """Seconds before the prefill of an open admitted now starts (0 with nothing queued or nothing measured)."""
        return self.cost.predict(self.queued_opens, self.queued_tokens) if self.queued_opens else 0.0

    def refusal(self, deadline_s: float) -> Overloaded | None:
        """The 429 for an open whose wait for the queue ahead is predicted past ``deadline_s``, or
        None (admitted: call :meth:`started`); one probe is let through per ``retry_after_s``."""
        wait = self.predicted_wait()
        if wait <= deadline_s:
            return None
        if self.clock() - self._last_admitted >= self.retry_after_s:
            self.probes += 1
            return None
        self.shed += 1
        retry = max(self.retry_after_s, min(30.0, wait - deadline_s))
        return Overloaded(f"the prefill queued ahead of this open would take about {wait:.1f} s, past the open's "
                          f"deadline of {deadline_s:g} s", retry_after=round(retry, 1), reason="open_deadline")

    def started(self, prompt_tokens: int) -> QueuedOpen:
        """Queue an admitted open; its ticket for :meth:`finished`."""
        self.queued_opens += 1
        self.queued_tokens += prompt_tokens
        self._last_admitted = now = self.clock()
        return QueuedOpen(prompt_tokens, self.queued_opens, self.queued_tokens, now)

    def finished(self, ticket: QueuedOpen, measured: bool) -> None:
        """An open left the queue. ``measured``: its time is a sample (its first token came, or it
        was cut at its deadline: a lower bound); an open that failed otherwise is none."""
        self.queued_opens = max(0, self.queued_opens - 1)
        self.queued_tokens = max(0, self.queued_tokens - ticket.prompt_tokens)
        if measured:
            self.cost.observe(OpenSample(ticket.opens, ticket.tokens, self.clock() - ticket.at))

    def state(self) -> dict:
        return {"queued_opens": self.queued_opens, "queued_tokens": self.queued_tokens,
                "fixed_s": self.cost.fixed, "per_token_s": self.cost.per_token, "samples": len(self.cost.samples),
                "shed": self.shed, "probes": self.probes}


def deadline_refusal(deadline_s: float, retry_after_s: float) -> Overloaded:
    """The 429 for an admitted open whose prefill had not started at its deadline (it was dropped)."""
    return Overloaded(f"the open's prefill did not start within its deadline of {deadline_s:g} s; it was dropped",
                      retry_after=retry_after_s, reason="open_deadline_passed")
