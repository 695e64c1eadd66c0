"""A replica's own figures over a window, from two of its ``GET /v1/stats`` snapshots
(:meth:`deploy.verifier.counters.ReplicaCounters.to_dict`): what a load test reports of its verifier and the
simulation of it (sim/system.py). Pure module."""

from __future__ import annotations


def window_figures(before: dict, after: dict) -> dict | None:
    """A replica's own figures between two of its ``/v1/stats`` snapshots (:meth:`ReplicaCounters.to_dict`):
    verify forwards a second, sessions and rows a forward, a forward's CPU (ms), and a verify round's mean time
    in the replica (ms: its handler's queue, batch wait, forward(s) and reply). None without a verify round and
    forward between them."""
    def grew(key: str) -> float:
        return after[key] - before[key]

    up, forwards, rounds = grew("uptime_seconds"), grew("verify_forwards_total"), grew("verify_requests_total")
    if up <= 0 or forwards <= 0 or rounds <= 0:
        return None
    cpu = after["busy_cpu_seconds"]["verify"] - before["busy_cpu_seconds"]["verify"]
    return {"verify_forwards_per_s": forwards / up, "sessions_per_forward": grew("verify_sessions_total") / forwards,
            "rows_per_forward": grew("verify_rows_total") / forwards, "forward_cpu_ms": 1e3 * cpu / forwards,
            "round_ms_mean": 1e3 * grew("verify_request_seconds_total") / rounds}


def mean_figures(figures: list[dict | None]) -> dict | None:
    """Replicas' :func:`window_figures` averaged figure by figure (None: none had any)."""
    have = [f for f in figures if f]
    return {k: sum(f[k] for f in have) / len(have) for k in have[0]} if have else None
