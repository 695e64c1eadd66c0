"""Pacing hints: draft depth (SpecEdge §4.3) and load-aware tree budget.

Depth: the verifier always has a batch ready if each edge's cycle (draft time + RTT)
matches the verifier's cycle (batch verify time), so the hint is
``depth = (T_verify - RTT) / T_draft_per_forward`` clamped to the configured range,
from the verify time the replica measures and the draft time / RTT each edge reports.

Tree budget: verifying a tree is nearly free while the verifier is memory-bound and
costs real compute when it is compute-bound (many sessions; any CPU). The forward time
is modelled as ``t(tokens) = a + b * tokens`` (online least squares with exponential
forgetting over recent forwards); with ``S`` sessions sharing the verifier and trees of
``n`` nodes, verified tokens per second of verifier time are
``S * E[tokens/round | n] / t(S * (n + 1))``. The hint is the budget that maximizes it,
with ``E[tokens/round | n]`` the observed mean per budget bucket (EMA), interpolated in
log(n) where a bucket has no data yet. Pure module.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class LinearCost:
    """Online weighted least squares of ``t = a + b * x`` with forgetting factor."""

    decay: float = 0.98
    _sw: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self._sw = d * self._sw + 1
        self._sx = d * self._sx + x
        self._sy = d * self._sy + y
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * y

    @property
    def count(self) -> float:
        return self._sw

    def coefficients(self) -> tuple[float, float]:
        if self._sw == 0:
            return 0.0, 0.0
        mx, my = self._sx / self._sw, self._sy / self._sw
        var = self._sxx / self._sw - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):  # one batch size seen so far: all cost per token
            return 0.0, my / max(mx, 1.0)
        b = max((self._sxy / self._sw - mx * my) / var, 0.0)
        a = max(my - b * mx, 0.0)
        return a, b

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


@dataclass
class Pacer:
    min_depth: int = 1
    max_depth: int = 12
    default_depth: int = 4
    budgets: tuple[int, ...] = (8, 16, 32, 64)
    default_budget: int = 32
    ema: float = 0.2
    cost: LinearCost = field(default_factory=LinearCost)
    _tokens_per_round: dict[int, float] = field(default_factory=dict)

    def observe_forward(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)

    def _bucket(self, tree_nodes: int) -> int:
        i = bisect.bisect_left(self.budgets, tree_nodes)
        return self.budgets[min(i, len(self.budgets) - 1)]

    def observe_round(self, tree_nodes: int, emitted: int) -> None:
        b = self._bucket(max(tree_nodes, 1))
        old = self._tokens_per_round.get(b)
        self._tokens_per_round[b] = emitted if old is None else (1 - self.ema) * old + self.ema * emitted

    def expected_tokens(self, n: int) -> float:
        """E[tokens per round | budget n]: observed, else interpolated in log(n)."""
        obs = self._tokens_per_round
        if n in obs:
            return obs[n]
        if not obs:
            return 1.0 + 0.5 * math.log2(1 + n)  # prior: grows slowly with tree size
        # scale the nearest observed bucket by the prior's ratio
        near = min(obs, key=lambda m: abs(math.log(m) - math.log(n)))
        prior = lambda m: 1.0 + 0.5 * math.log2(1 + m)  # noqa: E731
        return max(1.0, obs[near] * prior(n) / prior(near))

    def budget_hint(self, sessions: int) -> int:
        if self.cost.count < 3:
            return self.default_budget
        s = max(sessions, 1)
        best = max(self.budgets, key=lambda n: s * self.expected_tokens(n) / max(self.cost.predict(s * (n + 1)), 1e-6))
        return best

    def depth_hint(self, sessions: int, budget: int, draft_ms: float, rtt_ms: float) -> int:
        """Draft forwards so that edge draft time + RTT ~= the verifier's cycle."""
        if draft_ms <= 0 or self.cost.count < 3:
            return min(self.default_depth, budget)
        verify_ms = 1000.0 * self.cost.predict(max(sessions, 1) * (budget + 1))
        forwards = (verify_ms - rtt_ms) / draft_ms  # inf for a denormal draft_ms: clamped below, never int()ed
        cap = min(self.max_depth, budget)
        if not forwards < cap:  # also NaN
            return max(self.min_depth, cap)
        return max(self.min_depth, min(cap, round(forwards)))
