"""Tenant shares under contention, counted apart from the scheduler that enforces them (issue 61, item 7).

A verifier replica shares each forward among tenants by weight (:mod:`deploy.verifier.scheduler`).
Two tenants both left waiting by a forward were both constrained by it; over the forwards where a
pair was, each tenant's forward tokens over its weight must come out equal within ``tolerance``.
A forward where fewer than two tenants were left waiting constrains no one's share. Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations


@dataclass
class TenantShares:
    weights: dict[str, float]
    default_weight: float = 1.0
    min_forwards: int = 50  # a pair contended in fewer forwards is not judged
    _served: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # pair -> [a/w_a, b/w_b, forwards]

    def observe(self, batch_tokens: dict[str, int], waiting: dict[str, int]) -> None:
        """One forward: the tokens each tenant got in it, and the requests each left waiting."""
        left = sorted(t for t, n in waiting.items() if n)
        for a, b in combinations(left, 2):
            s = self._served.setdefault((a, b), [0.0, 0.0, 0])
            s[0] += batch_tokens.get(a, 0) / self.weights.get(a, self.default_weight)
            s[1] += batch_tokens.get(b, 0) / self.weights.get(b, self.default_weight)
            s[2] += 1

    def ratios(self) -> dict[str, dict]:
        """Per contended pair: the forwards it was contended in, and the smaller weighted service
        over the larger (1.0 = shares exactly by weight)."""
        return {f"{a}/{b}": {"forwards": n, "ratio": min(x, y) / max(x, y) if max(x, y) else 1.0}
                for (a, b), (x, y, n) in sorted(self._served.items())}

    def within(self, tolerance: float) -> bool:
        return all(r["ratio"] >= 1 - tolerance for r in self.ratios().values() if r["forwards"] >= self.min_forwards)
