"""Which verification rule a request gets (``AgentConfig.verify = "auto"``; issue 17).

All rules are exact (:mod:`deploy.verifier.acceptance`); they differ in speed only:

- greedy requests -> ``match`` (sample-then-match trees): with a point-mass target every
  rule accepts exactly the argmax's child, and SpecExec trees cover the draft's top-k best.
- temperature > 0 -> whichever of ``tree-rejection``, ``rejection`` (chains) and ``match``
  has measured best on this agent at this temperature: the measure is generated tokens per
  second of the whole generation (draft forwards, uplink, verification and acceptance
  together), an EMA over generations per (rule, temperature rounded to 0.1). Rules not yet
  measured at that temperature are tried first, in :data:`SAMPLED_RULES` order (the order the
  embedded pair ranked them by tokens per verify round at T = 0.7: benchmarks/results/README.md);
  afterwards every ``explore_every``-th request runs
  the runner-up, so a changed link, draft or prompt mix is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deploy.verifier.sampling import SamplingParams

SAMPLED_RULES = ("match", "rejection", "tree-rejection")  # untried rules are tried in this order


@dataclass
class VerifyPolicy:
    explore_every: int = 8
    alpha: float = 0.3  # EMA weight of one generation
    min_tokens: int = 8  # shorter generations say too little to count
    rates: dict[tuple[str, float], float] = field(default_factory=dict)  # (rule, bucket) -> tokens/s
    requests: dict[float, int] = field(default_factory=dict)  # bucket -> sampled requests so far

    @staticmethod
    def bucket(params: SamplingParams) -> float:
        return round(params.temperature, 1)

    def choose(self, params: SamplingParams) -> str:
        if params.greedy:
            return "match"
        b = self.bucket(params)
        n = self.requests[b] = self.requests.get(b, 0) + 1
        untried = [r for r in SAMPLED_RULES if (r, b) not in self.rates]
        if untried:
            return untried[0]
        ranked = sorted(SAMPLED_RULES, key=lambda r: -self.rates[(r, b)])
        return ranked[1] if n % self.explore_every == 0 else ranked[0]

    def observe(self, rule: str, params: SamplingParams, tokens: int, seconds: float) -> None:
        if params.greedy or tokens < self.min_tokens or seconds <= 0:
            return
        key = (rule, self.bucket(params))
        x = tokens / seconds
        self.rates[key] = x if key not in self.rates else (1 - self.alpha) * self.rates[key] + self.alpha * x
