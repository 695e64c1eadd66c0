"""The target's cost: seconds of one verifier round from what its forward reads and computes,
fitted from the project's own measurements (issue 61).

A profile is a ``benchmarks.verify_step`` JSON, on any device (this CPU, the committed H100/H200
runs, a card's ``make gpu-check``): ``conditions`` (model, dtype, device) and ``rows`` of
``{prefix, sessions, nodes, rows, round_ms}``. A round of ``S`` sessions, session ``i`` with
``r_i`` new rows over a KV of ``k_i`` tokens, costs

    t = c0 + c_rows * sum(r_i) + c_sessions * S + c_kv * sum(k_i) + c_kv_rows * sum(k_i * r_i)

(every ``c >= 0``: weights read once, per-row compute, per-session overhead, KV read once per
session as a tiled kernel does, KV read per row as a row-wise kernel does), fitted by
non-negative least squares in relative error, times the measured rounds' own residual (measured
over fitted), interpolated piecewise-linearly in KV length, log sessions and log rows per session
and held at the edges of what was measured: the cost is the measurement wherever one was made, the
linear form in between and beyond. Where the profile measured prefills (rows of group ``prefill``:
``{prefix, tokens, round_ms}``, a forward of ``n`` prompt tokens alone), a chunk of ``n`` tokens over
``k`` of KV added to a forward of ``r`` rows costs ``P(r + n) - P(r) + c_kv_rows * n * k``, ``P`` the
measured prefills' curve from a one-row forward on (the weights are read once: a small chunk on a
small forward costs little a token, on a full one what compute costs); where it did not, a chunk is
the same forward: ``n`` rows of one session over the KV written before it and half its own (a row
reads its causal prefix). Repeated rounds of a case (``runs_ms``) give the spread of a round around
its cost (log-normal, ``spread``). Pure module (numpy).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FEATURES = ("fixed", "rows", "sessions", "kv", "kv_rows")


class ProfileError(ValueError):
    """A cost profile that cannot be used: the message names the field."""


@dataclass(frozen=True)
class Forward:
    """What one forward reads and computes: per session, its new rows and its KV before them."""

    rows: tuple[int, ...]  # [S]
    kv: tuple[float, ...]  # [S]

    def features(self) -> np.ndarray:
        r, k = np.asarray(self.rows, float), np.asarray(self.kv, float)
        return np.array([1.0, r.sum(), float(len(r)), k.sum(), (k * r).sum()])


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk: ``tokens`` prompt tokens over ``kv`` tokens already in its session's KV."""

    tokens: int
    kv: int


@dataclass(frozen=True)
class PrefillCost:
    """The measured prefill curve: seconds of a forward of ``n`` prompt tokens alone over no KV,
    piecewise linear through the measured prefills (their attention over a prefix taken out) from
    ``(0, 0)`` and ``(1, a one-row forward)``, the last slope beyond. A chunk added to a forward
    that already has ``r`` rows adds ``curve(r + n) - curve(r)`` and its rows' reads of the KV
    before it (``attention`` seconds per row and token read)."""

    tokens: tuple[float, ...]  # ascending, from 0
    seconds: tuple[float, ...]
    attention: float

    def curve(self, n: float) -> float:
        if n <= self.tokens[-1]:
            return float(np.interp(n, self.tokens, self.seconds))
        slope = (self.seconds[-1] - self.seconds[-2]) / (self.tokens[-1] - self.tokens[-2])
        return self.seconds[-1] + slope * (n - self.tokens[-1])

    def added(self, rows_before: int, c: Chunk) -> float:
        """What chunk ``c`` adds to a forward of ``rows_before`` rows."""
        return self.curve(rows_before + c.tokens) - self.curve(rows_before) + self.attention * c.tokens * c.kv

    @classmethod
    def fit(cls, rows: list[dict], one_row: float, attention: float, source: str) -> "PrefillCost":
        by_n: dict[int, list[float]] = {}
        for i, r in rows:
            try:
                n, k, ms = int(r["tokens"]), int(r["prefix"]), float(r["round_ms"])
            except (KeyError, TypeError, ValueError):
                raise ProfileError(f"cost profile {source}: rows[{i}] (prefill) needs tokens, prefix and round_ms") \
                    from None
            if n < 1 or k < 0 or not ms > 0:
                raise ProfileError(f"cost profile {source}: rows[{i}] has an impossible value {r}")
            by_n.setdefault(n, []).append(ms / 1000.0 - attention * n * k)
        points = {0: 0.0, 1: one_row, **{n: statistics.fmean(v) for n, v in by_n.items()}}
        ns = sorted(points)
        seconds = list(itertools.accumulate((points[n] for n in ns), max))  # a longer prefill never costs less
        return cls(tuple(float(n) for n in ns), tuple(seconds), attention)


@dataclass(frozen=True)
class CostProfile:
    model: str
    dtype: str
    device: str
    coefficients: tuple[float, ...]  # seconds per unit of each of FEATURES
    source: str = ""
    max_error: float = 0.0  # the fit's largest relative error over the measured rounds
    spread: float = 0.0  # sigma of log(round / its case's median) over the repeated rounds (``runs_ms``)
    residuals: "Residuals | None" = None  # measured over fitted, where measured
    prefill: PrefillCost | None = None  # None: the profile measured no prefill

    def seconds(self, f: Forward, chunks: tuple[Chunk, ...] = ()) -> float:
        """One forward of verify rows ``f`` and prefill ``chunks``."""
        if chunks and self.prefill is None:  # a chunk's rows cost what a tree's do (extrapolated), each over
            # its causal prefix: the KV before the chunk and, on average, half the chunk's own rows
            f = Forward(f.rows + tuple(c.tokens for c in chunks), f.kv + tuple(c.kv + c.tokens / 2 for c in chunks))
            chunks = ()
        t, rows = 0.0, sum(f.rows)
        if f.rows:
            t = float(np.dot(self.coefficients, f.features()))
            t *= self.residuals.ratio(f) if self.residuals else 1.0
        for c in chunks:  # each chunk on top of the rows before it
            t += self.prefill.added(rows, c)
            rows += c.tokens
        return t

    def check(self, model: str, dtype: str) -> None:
        """Refuse a profile measured on another model or in another dtype (by name)."""
        if _norm(model) not in _norm(self.model) and _norm(self.model) not in _norm(model):
            raise ProfileError(f"cost profile {self.source}: conditions.model is {self.model!r}, "
                               f"the deployment serves {model!r}")
        if _norm(dtype) != _norm(self.dtype):
            raise ProfileError(f"cost profile {self.source}: conditions.dtype is {self.dtype!r}, "
                               f"the deployment runs {dtype!r}")

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ProfileError(f"cost profile {path}: cannot read it as JSON ({e})") from None
        return cls.fit(data, str(path))

    @classmethod
    def fit(cls, data: dict, source: str = "") -> "CostProfile":
        cond = data.get("conditions") if isinstance(data, dict) else None
        if not isinstance(cond, dict):
            raise ProfileError(f"cost profile {source}: no 'conditions' object (a benchmarks.verify_step JSON)")
        for key in ("model", "dtype"):
            if not isinstance(cond.get(key), str):
                raise ProfileError(f"cost profile {source}: conditions.{key} is missing")
        rows = data.get("rows")
        rows = rows if isinstance(rows, list) else []
        prefills, rounds = [], []
        for i, r in enumerate(rows):
            (prefills if isinstance(r, dict) and r.get("group") == "prefill" else rounds).append((i, r))
        if len(rounds) < len(FEATURES):
            raise ProfileError(f"cost profile {source}: 'rows' needs at least {len(FEATURES)} measured rounds")
        x, y, points = [], [], []
        for i, r in rounds:
            try:
                s, n, p, ms = int(r["sessions"]), int(r["nodes"]), int(r["prefix"]), float(r["round_ms"])
            except (KeyError, TypeError, ValueError):
                raise ProfileError(f"cost profile {source}: rows[{i}] needs sessions, nodes, prefix and round_ms") \
                    from None
            if s < 1 or n < 0 or p < 0 or not ms > 0:
                raise ProfileError(f"cost profile {source}: rows[{i}] has an impossible value {r}")
            x.append(Forward((n + 1,) * s, (p,) * s).features())
            y.append(ms / 1000.0)
            points.append((p, s, n + 1))
        coef, residuals, err = fit_with_residuals(x, y, points)
        logs = [math.log(ms / float(np.median(r["runs_ms"]))) for r in rows if isinstance(r.get("runs_ms"), list)
                and len(r["runs_ms"]) > 1 for ms in r["runs_ms"] if ms > 0]
        device = str(cond.get("device") or "cpu")
        if device == "cpu" and cond.get("cpu"):
            device = f"cpu ({cond['cpu']})"
        spread = float(np.std(logs)) if len(logs) > 1 else 0.0
        rounds_only = cls(cond["model"], cond["dtype"], device, coef, source, err, spread, residuals)
        if not prefills:
            return rounds_only
        one_row = rounds_only.seconds(Forward((1,), (0,)))  # the forward every forward is: the weights, one row
        return dataclasses.replace(rounds_only, prefill=PrefillCost.fit(prefills, one_row, coef[4], source))


class Residuals:
    """Measured over fitted round time at each measured ``(prefix, sessions, rows per session)``,
    interpolated piecewise-linearly (in log) over KV length, then log sessions, then log rows per
    session, each held at its measured edges; repeated cases are averaged."""

    def __init__(self, grid: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]]):
        self.grid = grid  # prefix -> sessions -> (log rows per session [n], log ratio [n]), ascending

    @classmethod
    def of(cls, points: list[tuple[int, int, int]], ratios: list[float]) -> "Residuals":
        acc: dict[tuple[int, int, int], list[float]] = {}
        for point, ratio in zip(points, ratios):
            acc.setdefault(point, []).append(math.log(ratio))
        grid: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        for (p, s, r) in sorted(acc):
            xs, ys = grid.setdefault(p, {}).get(s, ((), ()))
            grid[p][s] = (np.append(xs, math.log(r)), np.append(ys, float(np.mean(acc[(p, s, r)]))))
        return cls(grid)

    def ratio(self, f: Forward) -> float:
        s = len(f.rows)
        rows, kv = sum(f.rows) / s, sum(f.kv) / s
        return math.exp(_between(sorted(self.grid), kv, lambda p: _between(
            sorted(self.grid[p]), math.log(s), lambda s_: float(np.interp(math.log(rows), *self.grid[p][s_])),
            key=math.log)))


def _between(knots: list, x: float, value, key=lambda k: k) -> float:
    """``value`` at ``x`` interpolated linearly between the two ``knots`` around it (held at the ends)."""
    at = [key(k) for k in knots]
    if x <= at[0] or len(knots) == 1:
        return value(knots[0])
    if x >= at[-1]:
        return value(knots[-1])
    i = next(j for j in range(1, len(at)) if x < at[j])
    w = (x - at[i - 1]) / (at[i] - at[i - 1])
    return (1 - w) * value(knots[i - 1]) + w * value(knots[i])


def fit_with_residuals(x: list, y: list[float], points: list[tuple[int, int, int]]) -> tuple[tuple, "Residuals", float]:
    """Coefficients of ``y`` on features ``x`` (:func:`nnls_relative`), the measured-over-fitted residual at
    each of ``points``, and the fit's largest relative error."""
    x, y = np.array(x), np.array(y)
    coef = nnls_relative(x, y)
    fitted = x @ coef
    ratios = [float(m / f) if f > 0 else 1.0 for m, f in zip(y, fitted)]
    return tuple(float(c) for c in coef), Residuals.of(points, ratios), float(np.max(np.abs(fitted - y) / y))


def nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||(x c - y) / y|| over c >= 0: every subset of the features solved by least
    squares, the best feasible one kept (exact for a handful of features)."""
    xw, yw = x / y[:, None], np.ones_like(y)
    best, best_err = np.zeros(x.shape[1]), float("inf")
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            c, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
            if np.any(c < 0):
                continue
            full = np.zeros(x.shape[1])
            full[list(cols)] = c
            err = float(np.sum((xw @ full - yw) ** 2))
            if err < best_err:
                best, best_err = full, err
    return best


def _norm(s: str) -> str:
    return s.lower().replace("torch.", "").replace(" ", "")


@dataclass(frozen=True)
class HostCost:
    """The host's CPU outside the forward, per request (zero when not given): ``router_s`` in the
    router's process; ``replica_s`` on the verifier replica's event loop, before the request is
    queued (``replica_tree_s`` more for a tree); ``forward_s`` per forward in its forward thread;
    ``client_s`` in the load generator's (a request's send and its reply read, timed by the
    client). ``reply_share`` of the router's is spent reading the reply (while the request counts as
    in flight), ``client_reply_share`` of the client's (None: ``reply_share``), the rest before the
    call: of the router's, ``admit_share`` before its admission (a 429 pays only that), the rest
    after it, in flight as the router's asyncio loop runs a request's admission as soon as it reads
    it. ``cores``: the CPUs these processes and the forwards share, less ``background_cores`` of other processes (Ray's
    agents, GCS); 0: each process has a core of its own; those take ``burst_cores`` more for
    ``burst_s`` every ``burst_every_s`` (Ray's dashboard agent, every 10 s;
    ``benchmarks/bursts.py``). ``client_weight``: the load generator's claim on the shared cores
    against one server process's (1: the OS shares them by thread; a client given the CPU first, in
    a session of its own at nice n, claims 1.25 ** -n). Measured over the verify rounds of a served
    run (CPU seconds by process)."""

    router_s: float = 0.0
    replica_s: float = 0.0
    replica_tree_s: float = 0.0  # more per verify request with a tree (its nodes' frame, truncation, walk)
    forward_s: float = 0.0  # the replica's per forward, outside the model (packing, commit, bookkeeping)
    client_s: float = 0.0
    cores: float = 0.0
    background_cores: float = 0.0
    reply_share: float = 0.0
    admit_share: float = 1.0
    burst_cores: float = 0.0
    burst_s: float = 0.0
    burst_every_s: float = 0.0
    client_weight: float = 1.0
    client_reply_share: float | None = None
    source: str = ""

    @property
    def router_parts_s(self) -> tuple[float, float, float]:
        """The router's CPU per request: before admission, after it before the call, reading the reply."""
        before = self.router_s * (1.0 - self.reply_share)
        return before * self.admit_share, before * (1.0 - self.admit_share), self.router_s * self.reply_share

    @property
    def client_parts_s(self) -> tuple[float, float]:
        """The client's CPU per request: sending it, reading its reply."""
        share = self.reply_share if self.client_reply_share is None else self.client_reply_share
        return self.client_s * (1.0 - share), self.client_s * share

    @property
    def shared_cores(self) -> float:
        """The cores the modelled processes share (0: unshared)."""
        return max(0.0, self.cores - self.background_cores)

    @classmethod
    def load(cls, path: str | Path | None) -> "HostCost":
        if path is None:
            return cls()
        try:
            d = json.loads(Path(path).read_text())
            host = cls(float(d["router_ms_per_request"]) / 1e3, float(d["replica_ms_per_request"]) / 1e3,
                       float(d.get("replica_tree_ms_per_request", 0.0)) / 1e3,
                       float(d.get("replica_ms_per_forward", 0.0)) / 1e3,
                       float(d.get("client_ms_per_request", 0.0)) / 1e3, float(d.get("cores", 0.0)),
                       float(d.get("background_cores", 0.0)), float(d.get("reply_share", 0.0)),
                       float(d.get("admit_share", 1.0)), float(d.get("burst_cores", 0.0)), float(d.get("burst_s", 0.0)),
                       float(d.get("burst_every_s", 0.0)), float(d.get("client_weight", 1.0)),
                       None if d.get("client_reply_share") is None else float(d["client_reply_share"]), str(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ProfileError(f"host cost {path}: needs router_ms_per_request and replica_ms_per_request ({e})") \
                from None
        shares = (host.reply_share, host.admit_share, host.client_reply_share or 0.0)
        if min(host.router_s, host.replica_s, host.replica_tree_s, host.forward_s, host.client_s, host.cores,
               host.background_cores, host.burst_cores, host.burst_s) < 0 or (
                host.cores and host.shared_cores <= 0) or not all(0 <= x <= 1 for x in shares) or (
                host.client_weight <= 0):
            raise ProfileError(f"host cost {path}: every figure must be >= 0, cores above background_cores, "
                               "reply_share, admit_share and client_reply_share within [0, 1], client_weight above 0")
        if host.burst_cores and not 0 < host.burst_s < host.burst_every_s:
            raise ProfileError(f"host cost {path}: burst_s must be above 0 and below burst_every_s")
        return host
