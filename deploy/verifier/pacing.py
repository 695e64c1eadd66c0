"""Pacing hints: draft depth (SpecEdge §4.3) and the load-aware tree budget.

Depth: ``(T_verify - RTT) / T_draft_per_forward``, clamped; budget: the tree size ``n`` (0 = no tree) with the most
verified tokens per server CPU-second. The formulas: docs/verifier.md, "Pacing". Pure module."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from deploy.verifier.forward_cost import PiecewiseCost


def _prior(n: int) -> float:
    """Tokens per round expected of an ``n``-node tree before any is observed: grows slowly."""
    return 1.0 + 0.5 * math.log2(1 + n)


@dataclass
class Pacer:
    min_depth: int = 1
    max_depth: int = 12
    default_depth: int = 4
    budgets: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64)
    default_budget: int = 32
    ema: float = 0.2
    cost: PiecewiseCost = field(default_factory=PiecewiseCost)
    explore_every: int = 32  # every Nth hint asks for another budget: the best tree while "no tree" pays best,
    # else a neighbour of the best, so the costs and tokens of the budgets beside it stay measured
    explore_alone: int = 4  # ... every Nth for a session alone when that tree is within explore_margin
    explore_margin: float = 0.15
    round_overhead_s: float = 0.0  # server CPU per request outside the forward
    tree_margin: float = 0.0  # from 2 sessions up, a tree must be predicted this much better than no tree
    fill: float = 2.0  # verifier.batch_fill: a forward waits for sessions due within fill x its time
    stale_rounds: int = 64  # a bucket no tree round has refreshed in this many tree rounds is interpolated again
    _tokens_per_round: dict[int, float] = field(default_factory=dict)
    _tree_rounds: int = 0  # tree rounds observed
    _seen: dict[int, int] = field(default_factory=dict)  # bucket -> _tree_rounds at its last round
    _verified: dict[int, float] = field(default_factory=dict)  # bucket -> EMA of the nodes verified of its trees
    _no_tree_hints: int = 0
    _tree_hints: int = 0
    _tree_batch: dict[int, float] = field(default_factory=dict)  # sessions -> EMA of sessions per tree forward
    _tree_batch_at: dict[int, int] = field(default_factory=dict)  # sessions -> cost.count at its last forward
    _state: int = 0  # counts observations: the rates below are cached for one state
    _rates_at: tuple = ()  # what _rates_cached was computed for
    _rates_cached: dict[int, float] = field(default_factory=dict)

    def with_own_estimates(self) -> "Pacer":
        """A pacer sharing this one's forward cost curve and tree batches, with tokens-per-round
        estimates of its own (a target version's or a draft class's, FlexSpec §III-C)."""
        return replace(self, _tokens_per_round={}, _seen={}, _verified={}, _tree_rounds=0, _no_tree_hints=0,
                       _tree_hints=0)

    def observe_forward(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)

    def observe_tree_batch(self, sessions: int, in_forward: int) -> None:
        """A forward of trees alone (no run-ahead step) carried ``in_forward`` of the replica's ``sessions``.
        A session count's EMA no such forward has refreshed in the cost curve's ``stale_forwards`` starts anew."""
        self._state += 1
        old = self._tree_batch.get(sessions) if self._batch_fresh(sessions) else None
        self._tree_batch[sessions] = in_forward if old is None else (1 - self.ema) * old + self.ema * in_forward
        self._tree_batch_at[sessions] = self.cost.count

    def _batch_fresh(self, sessions: int) -> bool:
        return self.cost.count - self._tree_batch_at.get(sessions, -math.inf) <= self.cost.stale_forwards

    def state(self) -> dict:
        """What the budget choice rests on: tokens per round and nodes verified by budget, sessions per tree
        forward by sessions."""
        return {"tokens_per_round": dict(self._tokens_per_round), "verified_nodes": dict(self._verified),
                "tree_sessions_per_forward": dict(self._tree_batch)}

    def _bucket(self, tree_nodes: int) -> int:
        i = bisect.bisect_left(self.budgets, tree_nodes)
        return self.budgets[min(i, len(self.budgets) - 1)]

    def observe_round(self, tree_nodes: int, emitted: int, verified: int | None = None) -> None:
        """A round into the bucket of the tree its edge sent (``tree_nodes``, as the hint caps it): its
        tokens, and the nodes the replica verified of it after its cut (``verified``; default all), each
        an EMA. A bucket's first round, or its first after ``stale_rounds`` tree rounds elsewhere, moves
        what the fresh buckets expect of it."""
        self._state += 1
        b = self._bucket(tree_nodes)
        if b <= 0:
            self._tokens_per_round[b] = (1 - self.ema) * self._tokens_per_round.get(b, 1.0) + self.ema * emitted
            return
        v = tree_nodes if verified is None else min(verified, tree_nodes)
        measured = b in self._verified and self._fresh(b)  # the common case: no interpolation on the reply path
        old = self._tokens_per_round[b] if measured else self.expected_tokens(b)
        rows = self._verified[b] if measured else v
        self._tree_rounds += 1
        self._seen[b] = self._tree_rounds
        self._tokens_per_round[b] = (1 - self.ema) * old + self.ema * emitted
        self._verified[b] = (1 - self.ema) * rows + self.ema * v

    def expected_tokens(self, n: int) -> float:
        """E[tokens per round | budget n]: observed, else interpolated in log(n)."""
        return self._expected(n, self._observed())

    def _observed(self) -> dict[int, float]:
        """The tree buckets' estimates that rounds still refresh: a bucket no tree has been sent in lately
        is interpolated from those, not kept at what it brought in another state of the replica."""
        return {m: v for m, v in self._tokens_per_round.items() if m > 0 and self._fresh(m)}

    def _fresh(self, bucket: int) -> bool:
        return self._seen.get(bucket, 0) >= self._tree_rounds - self.stale_rounds

    def _rows(self, n: int) -> float:
        """Nodes the replica verifies of a budget-``n`` tree: as its bucket's rounds measured, else ``n``."""
        return self._verified[n] if n in self._verified and self._fresh(n) else n

    @staticmethod
    def _expected(n: int, obs: dict[int, float]) -> float:
        if n <= 0:
            return 1.0  # no tree: the bonus token only
        if n in obs:
            return obs[n]
        if not obs:
            return _prior(n)
        # scale the nearest observed bucket by the prior's ratio
        near = min(obs, key=lambda m: abs(math.log(m) - math.log(n)))
        return max(1.0, obs[near] * _prior(n) / _prior(near))

    def _tree_sessions(self, sessions: int, n: int, away_s: float) -> float:
        """Sessions a forward of ``n``-node trees carries: as measured lately (else all), fewer when away
        past ``fill`` x its time."""
        s = max(sessions, 1)
        if s in self._tree_batch and self._batch_fresh(s):
            s = min(s, max(self._tree_batch[s], 1.0))
        t = self.cost.predict(sessions * (self._rows(n) + 1))
        if away_s > self.fill * t:
            s = min(s, max(1.0, sessions * t / (t + away_s)))
        return s

    def rates(self, sessions: int, ahead: int = 1, away_s: float = 0.0) -> dict[int, float]:
        """Verified tokens per second of server CPU, by budget ``n``, for ``sessions`` sending ``n``-node trees
        (verified as their bucket measured); with no tree a request carries ``ahead`` tokens. ``away_s``: the
        sessions' time away per round. Cached per state."""
        key = (self._state, self.cost.count, self.round_overhead_s, self.fill, sessions, ahead, away_s)
        if self._rates_at != key:
            obs = self._observed()
            self._rates_cached = {n: self._rate(sessions, n, ahead, away_s, self._expected(n, obs))
                                  for n in self.budgets}
            self._rates_at = key
        return self._rates_cached

    def _rate(self, sessions: int, n: int, ahead: int, away_s: float, per_round: float) -> float:
        s = max(sessions, 1)
        if n > 0:  # trees: the sessions a forward of trees carries
            s = self._tree_sessions(s, n, away_s)
        requests = s if n > 0 else s / max(ahead, 1)  # a tree: one request a round each
        return s * per_round / max(self.cost.predict(s * (self._rows(n) + 1)) + requests * self.round_overhead_s,
                                   1e-6)

    def best_budget(self, sessions: int, ahead: int = 1, away_s: float = 0.0) -> int:
        """The budget that pays best now (no exploration); the default until measured.
        ``ahead``: tokens a no-tree request brings back; ``away_s``: the edge's RTT; ``tree_margin`` from 2 sessions."""
        if self.cost.count < 3:
            return self.default_budget
        rate = self.rates(sessions, ahead, away_s)
        best = max(self.budgets, key=rate.__getitem__)
        if best > 0 and 0 in rate and sessions >= 2 and rate[best] < (1 + self.tree_margin) * rate[0]:
            return 0
        return best

    def budget_hint(self, sessions: int, ahead: int = 1, away_s: float = 0.0) -> int:
        """The hint a reply carries: :meth:`best_budget`, or every ``explore_every``-th hint another: while
        the best is "no tree", the best tree (every ``explore_alone``-th for a session alone within
        ``explore_margin``); else the budgets either side of the best, in turn."""
        best = self.best_budget(sessions, ahead, away_s)
        trees = [n for n in self.budgets if n > 0]
        if not trees or self.cost.count < 3:
            return best
        if best == 0:
            self._no_tree_hints += 1
            rate = self.rates(sessions, ahead, away_s)
            tree = max(trees, key=rate.__getitem__)
            close = sessions <= 1 and rate[tree] >= (1 - self.explore_margin) * rate[0]
            if self._no_tree_hints % (self.explore_alone if close else self.explore_every) == 0:
                return tree
            return best
        self._tree_hints += 1
        if self._tree_hints % self.explore_every:
            return best
        i, up = self.budgets.index(best), self._tree_hints // self.explore_every % 2
        beside = [self.budgets[j] for j in (i - 1, i + 1) if 0 <= j < len(self.budgets)]
        return beside[up % len(beside)] if beside else best

    def depth_hint(self, sessions: int, budget: int, draft_ms: float, rtt_ms: float) -> int:
        """Draft forwards so that edge draft time + RTT ~= the verifier's cycle (one session: up to the budget)."""
        if budget <= 0:
            return 0  # no tree: no draft forwards
        if sessions <= 1:
            return max(self.min_depth, min(self.max_depth, budget))
        if draft_ms <= 0 or self.cost.count < 3:
            return min(self.default_depth, budget)
        # the whole budget's rows, not the rows its bucket had verified: with those (the replica's cut) the load
        # tests' depth hints fell and their tokens/s with them (docs/verifier.md, "Pacing")
        verify_ms = 1000.0 * self.cost.predict(max(sessions, 1) * (budget + 1))
        forwards = (verify_ms - rtt_ms) / draft_ms  # inf for a denormal draft_ms: clamped below, never int()ed
        cap = min(self.max_depth, budget)
        if not forwards < cap:  # also NaN
            return max(self.min_depth, cap)
        return max(self.min_depth, min(cap, round(forwards)))
