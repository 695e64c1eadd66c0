"""Which verification rule a request gets (``AgentConfig.verify = "auto"``; issue 17; docs/edge_agent.md,
"Choosing the rule").
Notes: docs/edge_agent.md, "edge_agent/verify_policy.py"."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specdec.sampling import SamplingParams

SAMPLED_RULES = ("match", "rejection", "tree-rejection")  # ties on the estimate go to the earlier rule
# measured tokens per verify round, embedded pair (benchmarks/results/README.md, "Sampled generation")
PRIOR: dict[float, dict[str, float]] = {
    0.7: {"match": 1.79, "rejection": 1.54, "tree-rejection": 1.58},
    1.0: {"match": 1.48, "rejection": 1.45, "tree-rejection": 1.47},
}
PRIOR_ROUNDS = 8.0  # the prior weighs as much as this many measured round trips
STATE_VERSION = 1


def prior(rule: str, temperature: float) -> float:
    """The prior tokens per verify round of ``rule`` at ``temperature`` (piecewise linear in T)."""
    ts = sorted(PRIOR)
    t = min(max(temperature, ts[0]), ts[-1])
    for lo, hi in zip(ts, ts[1:]):
        if lo <= t <= hi:
            w = (t - lo) / (hi - lo)
            return (1 - w) * PRIOR[lo][rule] + w * PRIOR[hi][rule]
    return PRIOR[ts[0]][rule]


@dataclass
class VerifyPolicy:
    explore_every: int = 8
    decay: float = 0.7  # weight of the earlier evidence when a new generation is observed
    min_rounds: int = 2  # generations with fewer round trips say too little to count
    # (rule, temperature bucket) -> [decayed tokens, decayed round trips] measured with that rule
    evidence: dict[tuple[str, float], list[float]] = field(default_factory=dict)
    requests: dict[float, int] = field(default_factory=dict)  # bucket -> sampled requests so far

    @staticmethod
    def bucket(params: SamplingParams) -> float:
        return round(params.temperature, 1)

    def estimate(self, rule: str, bucket: float) -> float:
        """Tokens per verify round trip expected of ``rule`` at this temperature bucket."""
        tok, rounds = self.evidence.get((rule, bucket), (0.0, 0.0))
        return (PRIOR_ROUNDS * prior(rule, bucket) + tok) / (PRIOR_ROUNDS + rounds)

    def choose(self, params: SamplingParams) -> str:
        if params.greedy:
            return "match"
        b = self.bucket(params)
        n = self.requests[b] = self.requests.get(b, 0) + 1
        best = max(SAMPLED_RULES, key=lambda r: self.estimate(r, b))  # max keeps the first of a tie
        if n % self.explore_every:
            return best
        others = [r for r in SAMPLED_RULES if r != best]
        return min(others, key=lambda r: (self.evidence.get((r, b), (0.0, 0.0))[1], -self.estimate(r, b)))

    def observe(self, rule: str, params: SamplingParams, tokens: float, rounds: float) -> None:
        """One generation with ``rule``: ``tokens`` produced by ``rounds`` verify round trips."""
        if params.greedy or rule not in SAMPLED_RULES or rounds < self.min_rounds:
            return
        key = (rule, self.bucket(params))
        tok, n = self.evidence.get(key, (0.0, 0.0))
        self.evidence[key] = [self.decay * tok + tokens, self.decay * n + rounds]

    # -- persistence (PolicyStore) ---------------------------------------------------------
    def to_dict(self) -> dict:
        return {"evidence": [{"rule": r, "temperature": b, "tokens": v[0], "rounds": v[1]}
                             for (r, b), v in sorted(self.evidence.items())],
                "requests": {str(b): n for b, n in sorted(self.requests.items())}}

    def load_dict(self, d: dict) -> None:
        """Take the evidence of a stored policy (entries that do not parse are skipped)."""
        for e in d.get("evidence", []):
            try:
                rule, b = str(e["rule"]), round(float(e["temperature"]), 1)
                tok, n = float(e["tokens"]), float(e["rounds"])
            except (KeyError, TypeError, ValueError):
                continue
            if rule in SAMPLED_RULES and tok >= 0 and n > 0 and tok == tok and n == n:
                self.evidence[(rule, b)] = [tok, n]
        for b, n in d.get("requests", {}).items():
            try:
                self.requests[round(float(b), 1)] = int(n)
            except (TypeError, ValueError):
                continue


def default_state_path() -> Path:
    """``$XDG_CACHE_HOME/specedge/verify_policy.json`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specedge" / "verify_policy.json"


@dataclass
class PolicyStore:
    """The measured evidence of ``auto`` across processes: one JSON file, one entry per (target,
    draft) pair (acceptance belongs to a pair). A missing or unreadable file is an empty one;
    writes go through a temporary file and ``os.replace`` (concurrent agents: the last one wins
    its pair's entry, the other pairs are kept)."""

    path: Path

    def _read(self) -> dict:
        try:
            d = json.loads(Path(self.path).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(d, dict) or d.get("version") != STATE_VERSION or not isinstance(d.get("pairs"), dict):
            return {}
        return d["pairs"]

    def load(self, pair: str, policy: VerifyPolicy) -> None:
        entry = self._read().get(pair)
        if isinstance(entry, dict):
            policy.load_dict(entry)

    def save(self, pair: str, policy: VerifyPolicy) -> None:
        path = Path(self.path)
        pairs = self._read()
        pairs[pair] = policy.to_dict()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": STATE_VERSION, "pairs": pairs}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
