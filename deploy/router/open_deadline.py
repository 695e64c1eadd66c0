"""Time-to-first-token admission for session opens (issue 56).

An open's first token waits for the prefill of every prompt admitted before it. The router
keeps the prefill queue in tokens (prompts admitted and not yet answered) and the measured
prefill rate (tokens per second of answered opens, an exponential moving average), and sheds
an open at the door when ``(queued + its prompt) / rate`` exceeds its deadline. An admitted
open that still runs past its deadline is answered 429 by the router (``deadline_refusal``).

Pure module (no Ray, no FastAPI).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import Overloaded

DEADLINE_HEADER = "x-open-deadline-s"


def request_deadline(header: str | None, default_s: float) -> float:
    """The deadline of one open: the header's value in seconds if given (capped at ``default_s``:
    a client may ask for less, never more), else ``default_s``. A bad value raises ValueError."""
    if header is None:
        return default_s
    value = float(header)
    if not value > 0:  # NaN too
        raise ValueError(f"{DEADLINE_HEADER} must be a positive number of seconds, got {header!r}")
    return min(value, default_s)


@dataclass
class PrefillForecast:
    """Predicts an open's wait for its first token from the queue in tokens and the rate."""

    retry_after_s: float = 1.0
    alpha: float = 0.2  # weight of the newest rate sample in the moving average
    queued_tokens: int = 0  # prompt tokens of admitted opens not yet answered
    rate: float | None = None  # measured prefill tokens/s; None until the first open is answered
    shed: int = 0

    def predicted_wait(self, prompt_tokens: int) -> float:
        """Seconds until the first token of an open of ``prompt_tokens`` admitted now (0 until a rate is known)."""
        if not self.rate:
            return 0.0
        return (self.queued_tokens + prompt_tokens) / self.rate

    def refusal(self, prompt_tokens: int, deadline_s: float) -> Overloaded | None:
        """The 429 for an open whose predicted first token is past ``deadline_s``, or None."""
        wait = self.predicted_wait(prompt_tokens)
        if wait <= deadline_s:
            return None
        self.shed += 1
        retry = max(self.retry_after_s, min(30.0, wait - deadline_s))
        return Overloaded(f"the first token would come in about {wait:.1f} s, past the open's deadline of "
                          f"{deadline_s:g} s", retry_after=round(retry, 1), reason="open_deadline")

    def started(self, prompt_tokens: int) -> int:
        """Queue an admitted open; returns the tokens to prefill before its first token (its own included)."""
        self.queued_tokens += prompt_tokens
        return self.queued_tokens

    def finished(self, prompt_tokens: int, work_tokens: int, seconds: float | None) -> None:
        """An open left the queue; ``work_tokens``: what :meth:`started` returned for it; ``seconds``: how
        long its answer took (None if it failed or was cut: no rate sample)."""
        self.queued_tokens = max(0, self.queued_tokens - prompt_tokens)
        if seconds is not None and seconds > 0:
            sample = work_tokens / seconds  # the queue ahead of it went through while it waited
            self.rate = sample if self.rate is None else (1 - self.alpha) * self.rate + self.alpha * sample


def deadline_refusal(deadline_s: float, retry_after_s: float) -> Overloaded:
    """The 429 for an admitted open still without its first token at its deadline."""
    return Overloaded(f"no first token within the open's deadline of {deadline_s:g} s; its prefill was dropped",
                      retry_after=retry_after_s, reason="open_deadline_passed")
