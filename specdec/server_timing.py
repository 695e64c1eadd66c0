"""The ``Server-Timing`` response header (W3C Server Timing): the router states how long it held a
verify round, from reading the request to its reply, so a client can tell the server's share of the
round it timed from its own and the network's."""

from __future__ import annotations

import math

HEADER = "Server-Timing"
METRIC = "router"  # the metric's name: the router's time, the verifier call included


def header_value(seconds: float) -> str:
    """The header's value for a round the router held ``seconds``."""
    return f"{METRIC};dur={seconds * 1e3:.2f}"


def router_ms(value: str | None) -> float | None:
    """The router's milliseconds in a ``Server-Timing`` value (several metrics, comma-separated, each
    ``name;param=value``); None without that metric or a finite, non-negative ``dur``."""
    for metric in (value or "").split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        if name != METRIC:
            continue
        for p in params:
            key, _, ms = p.partition("=")
            if key.strip() == "dur":
                try:
                    dur = float(ms.strip().strip('"'))
                except ValueError:
                    return None
                return dur if math.isfinite(dur) and dur >= 0 else None
    return None
