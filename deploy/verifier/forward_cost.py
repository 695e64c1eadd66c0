"""The forward's cost: seconds against the rows in the batch, fitted per replica as a hinge.

Used by the pacer, the batch loop's fill and the prefill budget. Why so fitted: docs/verifier.md, "Pacing"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class PiecewiseCost:
    """Forward seconds vs rows: ``t = a + b * max(0, rows - knee)``, ``b >= 0``, fitted over per-row-count EMAs.
    A row count no forward has had in the last ``stale_forwards`` leaves the fit until one has it again, so
    what a cold start's or a pause's forwards cost does not shape the curve for the replica's life."""

    ema: float = 0.1
    weight_cap: int = 32
    refit_every: int = 8
    stale_forwards: int = 1024
    _means: dict[float, list[float]] = field(default_factory=dict)  # rows -> [EMA seconds, count, last forward]
    _count: int = 0
    _since_fit: int = 0
    _fit: tuple[float, float, float] = (0.0, 0.0, 0.0)  # a, b, knee

    def observe(self, rows: float, seconds: float) -> None:
        self._count += 1
        m = self._means.get(float(rows))
        if m is None:
            self._means[float(rows)] = [float(seconds), 1, self._count]
        else:
            m[0] += self.ema * (float(seconds) - m[0])
            m[1], m[2] = min(m[1] + 1, self.weight_cap), self._count
        self._since_fit += 1
        if self._since_fit >= self.refit_every or self._count <= 3:
            self.refit()

    @property
    def count(self) -> int:
        """Forwards observed."""
        return self._count

    def points(self) -> list[tuple[float, float, float]]:
        """(rows, mean seconds, weight) per row count the fit keeps (seen in the last ``stale_forwards`` at its refit)."""
        return [(x, m, float(n)) for x, (m, n, _) in self._means.items()]

    def refit(self) -> None:
        self._since_fit = 0
        for x in [x for x, (*_, last) in self._means.items() if self._count - last > self.stale_forwards]:
            del self._means[x]
        if self._means:
            self._fit = _best_hinge(self.points())

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, knee)."""
        return self._fit

    def predict(self, rows: float) -> float:
        a, b, knee = self._fit
        return a + b * max(0.0, rows - knee)


def _best_hinge(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Weighted least squares of ``t = a + b * max(0, x - knee)``, ``b >= 0``, in relative error: (a, b, knee)."""
    points = sorted(points)
    obs = [(x, y) for x, y, _ in points]
    ws = [n / max(y, 1e-6) ** 2 for _, y, n in points]
    sw = sum(ws)
    swy = sum(w * y for w, (_, y) in zip(ws, obs))
    swyy = sum(w * y * y for w, (_, y) in zip(ws, obs))
    my = swy / sw
    # suffix sums over the points right of the knee: w, w x, w x^2, w y, w x y
    rw = rwx = rwxx = rwy = rwxy = 0.0
    tails = []  # (knee, the five suffix sums of the points with x > knee)
    i = len(obs)
    xs = sorted({x for x, _ in obs}, reverse=True)
    for knee in xs[1:] + [0.0]:
        while i > 0 and obs[i - 1][0] > knee:
            i -= 1
            (x, y), w = obs[i], ws[i]
            rw, rwx, rwxx, rwy, rwxy = rw + w, rwx + w * x, rwxx + w * x * x, rwy + w * y, rwxy + w * x * y
        tails.append((knee, rw, rwx, rwxx, rwy, rwxy))
    # equal fits (a knee left of every point) keep the first
    best, tie = (math.inf, my, 0.0, 0.0), 1e-9 * sum(n for *_, n in points)
    for knee, rw, rwx, rwxx, rwy, rwxy in reversed(tails):  # knee 0 first: it wins ties
        swh = rwx - knee * rw
        swhh = rwxx - 2 * knee * rwx + knee * knee * rw
        swhy = rwxy - knee * rwy
        var = swhh - swh * swh / sw
        cov = swhy - swh * swy / sw
        # var is a difference of large sums: one h for every point (one row count) leaves rounding
        # noise, not a slope, so it is compared with the sums' own size
        b = max(0.0, cov / var) if var > 1e-12 * swhh else 0.0
        a = (swy - b * swh) / sw
        err = a * a * sw + b * b * swhh + swyy + 2 * a * b * swh - 2 * a * swy - 2 * b * swhy
        if err < best[0] - tie:
            best = (err, a, b, knee)
    return best[1:]
