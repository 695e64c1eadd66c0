"""The target's cost: seconds of one verifier round from what its forward reads and computes,
fitted from the project's own measurements (issue 61).

A profile is a ``benchmarks.verify_step`` JSON, on any device (this CPU, the committed H100/H200
runs, a card's ``make gpu-check``): ``conditions`` (model, dtype, device) and ``rows`` of
``{prefix, sessions, nodes, rows, round_ms}``. A round of ``S`` sessions, session ``i`` with
``r_i`` new rows over a KV of ``k_i`` tokens, costs

    t = c0 + c_rows * sum(r_i) + c_sessions * S + c_kv * sum(k_i) + c_kv_rows * sum(k_i * r_i)

(every ``c >= 0``: weights read once, per-row compute, per-session overhead, KV read once per
session as a tiled kernel does, KV read per row as a row-wise kernel does), fitted by
non-negative least squares in relative error. A prefill chunk is the same forward: ``n`` rows of
one session over the KV written before it. Repeated rounds of a case (``runs_ms``) give the spread
of a round around its cost (log-normal, ``spread``). Pure module (numpy).
"""

from __future__ import annotations

import itertools
import json
import math
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
    kv: tuple[int, ...]  # [S]

    def features(self) -> np.ndarray:
        r, k = np.asarray(self.rows, float), np.asarray(self.kv, float)
        return np.array([1.0, r.sum(), float(len(r)), k.sum(), (k * r).sum()])


@dataclass(frozen=True)
class CostProfile:
    model: str
    dtype: str
    device: str
    coefficients: tuple[float, ...]  # seconds per unit of each of FEATURES
    source: str = ""
    max_error: float = 0.0  # the fit's largest relative error over the measured rounds
    spread: float = 0.0  # sigma of log(round / its case's median) over the repeated rounds (``runs_ms``)

    def seconds(self, f: Forward) -> float:
        return float(np.dot(self.coefficients, f.features()))

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
        if not isinstance(rows, list) or len(rows) < len(FEATURES):
            raise ProfileError(f"cost profile {source}: 'rows' needs at least {len(FEATURES)} measured rounds")
        x, y = [], []
        for i, r in enumerate(rows):
            try:
                s, n, p, ms = int(r["sessions"]), int(r["nodes"]), int(r["prefix"]), float(r["round_ms"])
            except (KeyError, TypeError, ValueError):
                raise ProfileError(f"cost profile {source}: rows[{i}] needs sessions, nodes, prefix and round_ms") \
                    from None
            if s < 1 or n < 0 or p < 0 or not ms > 0:
                raise ProfileError(f"cost profile {source}: rows[{i}] has an impossible value {r}")
            x.append(Forward((n + 1,) * s, (p,) * s).features())
            y.append(ms / 1000.0)
        coef = nnls_relative(np.array(x), np.array(y))
        err = float(np.max(np.abs(np.array(x) @ coef - y) / y))
        logs = [math.log(ms / float(np.median(r["runs_ms"]))) for r in rows if isinstance(r.get("runs_ms"), list)
                and len(r["runs_ms"]) > 1 for ms in r["runs_ms"] if ms > 0]
        device = str(cond.get("device") or "cpu")
        if device == "cpu" and cond.get("cpu"):
            device = f"cpu ({cond['cpu']})"
        spread = float(np.std(logs)) if len(logs) > 1 else 0.0
        return cls(cond["model"], cond["dtype"], device, tuple(float(c) for c in coef), source, err, spread)


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
    router's process, ``replica_s`` in the verifier replica's (its loop and bookkeeping, serialised
    with its forwards; ``replica_tree_s`` more for a tree, ``forward_s`` per forward), ``client_s`` in the load generator's (a request's send and its reply read,
    timed by the client); ``reply_share`` of each is spent reading the reply (the router's while
    the request counts as in flight), the rest before the call. ``cores``: the CPUs these processes and the forwards share, less
    ``background_cores`` of other processes (Ray's agents, GCS); 0: each process has a core of its
    own. Measured over the verify rounds of a served run (CPU seconds by process)."""

    router_s: float = 0.0
    replica_s: float = 0.0
    replica_tree_s: float = 0.0  # more per verify request with a tree (its nodes' frame, truncation, walk)
    forward_s: float = 0.0  # the replica's per forward, outside the model (packing, commit, bookkeeping)
    client_s: float = 0.0
    cores: float = 0.0
    background_cores: float = 0.0
    reply_share: float = 0.0
    source: str = ""

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
                       float(d.get("background_cores", 0.0)), float(d.get("reply_share", 0.0)), str(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ProfileError(f"host cost {path}: needs router_ms_per_request and replica_ms_per_request ({e})") \
                from None
        if min(host.router_s, host.replica_s, host.replica_tree_s, host.forward_s, host.client_s, host.cores,
               host.background_cores) < 0 or (
                host.cores and host.shared_cores <= 0) or not 0 <= host.reply_share <= 1:
            raise ProfileError(f"host cost {path}: every figure must be >= 0, cores above background_cores, "
                               "reply_share within [0, 1]")
        return host
