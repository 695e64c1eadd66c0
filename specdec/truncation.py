"""Server-side tree truncation at batch time: how many nodes of each tree one forward verifies, acting in this batch
where SpecEdge §4.3's pacing acts a round later. Lossless: a tree's prefix is a tree. docs/specdec.md."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

CONF_SCALE = 16.0  # wire confidence: u8 = round(-log p * 16), i.e. 1/16 nat steps up to 16 nats
DEFAULT_NODE_ALPHA = 0.6  # prior acceptance per tree level when an edge sends no confidences


def encode_confidence(logp: float) -> int:
    """Cumulative draft log-probability -> one byte (0 = certain, 255 = e^-16 or less)."""
    if not logp <= 0.0:  # NaN or positive: treat as certain
        return 0
    return min(255, round(-logp * CONF_SCALE))


def decode_confidence(byte: int) -> float:
    """One byte -> path probability."""
    return math.exp(-byte / CONF_SCALE)


def node_gains(parents: list[int], conf: list[int] | None = None, alpha: float = DEFAULT_NODE_ALPHA) -> list[float]:
    """Per node, in the order sent: its path probability from the confidence bytes, else ``alpha ** depth``,
    made non-increasing along the order (the best nodes form a prefix). Never fails on a malformed tree."""
    if conf is not None and len(conf) == len(parents):
        raw = [decode_confidence(c) for c in conf]
    else:
        depths: list[int] = []
        for i, p in enumerate(parents):
            depths.append(depths[p] + 1 if 0 <= p < i else 1)
        raw = [alpha ** d for d in depths]
    out, cap = [], 1.0
    for g in raw:
        cap = min(cap, g)
        out.append(cap)
    return out


@dataclass
class GainCalibration:
    """Scales draft path probabilities to observed acceptance: EMA of accepted over predicted accepted nodes."""

    ema: float = 0.1
    factor: float = 1.0

    def observe(self, predicted: float, accepted: int) -> None:
        if predicted > 0.05:
            ratio = min(4.0, max(0.05, accepted / predicted))
            self.factor = (1 - self.ema) * self.factor + self.ema * ratio

    def scale(self, gains: list[float]) -> list[float]:
        return [min(1.0, g * self.factor) for g in gains]


def choose_prefixes(gains: list[list[float]], cost: Callable[[int], float], base_rows: int = 0) -> list[int]:
    """Nodes to verify per session (a prefix length each). gains[s][j]: the expected gain of session ``s``'s ``j``-th
    node, non-increasing in ``j``; ``cost(rows)``: forward seconds; ``base_rows``: rows besides roots and nodes."""
    sessions = len(gains)
    if sessions == 0:
        return []
    take = [0] * sessions
    heap = [(-g[0], s) for s, g in enumerate(gains) if g]
    heapq.heapify(heap)
    rows = base_rows + sessions
    value = float(sessions)
    best_rate, best_take = value / max(cost(rows), 1e-9), list(take)
    while heap:
        neg, s = heapq.heappop(heap)
        take[s] += 1
        rows += 1
        value += -neg
        rate = value / max(cost(rows), 1e-9)
        if rate > best_rate:
            best_rate, best_take = rate, list(take)
        if take[s] < len(gains[s]):
            heapq.heappush(heap, (-gains[s][take[s]], s))
    return best_take
