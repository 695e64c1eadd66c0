"""Draft-depth control (docs/edge_agent.md, "Draft depth"): depth = draft forwards per tree.
Notes: docs/edge_agent.md, "edge_agent/depth.py"."""

from __future__ import annotations

from dataclasses import dataclass, field


class EMA:
    def __init__(self, alpha: float = 0.2, value: float | None = None):
        self.alpha, self.value = alpha, value

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


@dataclass
class Telemetry:
    """What the edge has measured so far (all times in milliseconds)."""

    ema: float = 0.2
    draft_ms: EMA = field(default=None)  # type: ignore[assignment]
    rtt_ms: EMA = field(default=None)  # type: ignore[assignment]
    # acceptance: EMA counts of accepted levels and misses (prior alpha = 0.8, FlexSpec Alg. 2)
    succ: float = 0.8
    fail: float = 0.2
    # online fit of server_ms = base + slope * nodes (EMA moments)
    _n: EMA = field(default=None)  # type: ignore[assignment]
    _s: EMA = field(default=None)  # type: ignore[assignment]
    _nn: EMA = field(default=None)  # type: ignore[assignment]
    _ns: EMA = field(default=None)  # type: ignore[assignment]

    def __post_init__(self):
        for name in ("draft_ms", "rtt_ms", "_n", "_s", "_nn", "_ns"):
            if getattr(self, name) is None:
                setattr(self, name, EMA(self.ema))

    @property
    def alpha(self) -> float:
        return self.succ / max(self.succ + self.fail, 1e-9)

    def observe_draft(self, seconds: float) -> None:
        self.draft_ms.update(seconds * 1e3)

    def observe_rtt(self, seconds: float) -> None:
        self.rtt_ms.update(seconds * 1e3)

    def observe_round(self, levels: int, accepted: int, nodes: int, round_ms: float) -> None:
        """A verify round: tree of ``levels`` levels and ``nodes`` nodes, ``accepted`` nodes kept."""
        if levels > 0:
            a = self.ema
            self.succ = (1 - a) * self.succ + a * accepted
            self.fail = (1 - a) * self.fail + a * (1.0 if accepted < levels else 0.0)
        s = max(round_ms - self.rtt_ms.get(0.0), 0.0)
        self._n.update(nodes)
        self._s.update(s)
        self._nn.update(nodes * nodes)
        self._ns.update(nodes * s)

    def server_fit(self) -> tuple[float, float]:
        """(base_ms, slope_ms_per_node) of the server-side time of a round."""
        n, s = self._n.get(), self._s.get()
        var = self._nn.get() - n * n
        slope = (self._ns.get() - n * s) / var if var > 1e-6 else 0.0
        slope = max(slope, 0.0)
        return max(s - slope * n, 0.0), slope


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens | K] under a per-level acceptance alpha: accepted levels + the bonus."""
    alpha = min(max(alpha, 0.0), 0.999)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def flexspec_depth(t: Telemetry, k_max: int, nodes_per_level: float = 4.0) -> int:
    """FlexSpec Eq. 11: argmax_K E[tokens | K] / (T_fixed + K * T_marginal)."""
    base, slope = t.server_fit()
    t_fixed = t.rtt_ms.get(0.0) + base
    t_marg = t.draft_ms.get(1.0) + slope * nodes_per_level
    t_fixed = max(t_fixed, 1e-3)
    best, best_rate = 1, -1.0
    for k in range(1, max(k_max, 1) + 1):
        rate = expected_tokens(t.alpha, k) / (t_fixed + k * t_marg)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


POLICIES = ("fixed", "server", "flexspec", "auto")


@dataclass
class DepthPolicy:
    """Which depth to draft next; see the module docstring for the rules."""

    kind: str = "auto"
    depth: int = 4  # fixed depth, and the fallback without measurements or hints
    max_depth: int = 12

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"depth policy must be one of {POLICIES}, got {self.kind!r}")

    def choose(self, t: Telemetry, hint: int = 0, nodes_per_level: float = 4.0, rounds: int = 0) -> int:
        if self.kind == "fixed":
            d = self.depth
        elif self.kind == "server":
            d = hint if hint > 0 else self.depth
        else:
            # before any round there is nothing to optimise: use the hint or the default
            d = flexspec_depth(t, self.max_depth, nodes_per_level) if rounds > 0 else (hint or self.depth)
            if self.kind == "auto" and hint > 0:
                d = min(d, hint)
        return max(1, min(d, self.max_depth))
