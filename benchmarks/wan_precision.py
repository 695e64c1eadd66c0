"""How closely the WAN proxy holds a round trip to the RTT it is asked for.

An echo server behind :class:`benchmarks.wan_proxy.WanProxy`; one connection sends a small
message and waits for it back, ``--trips`` times, at each ``--rtt-ms``. The excess of a round
trip is its time less the RTT less the same path's round trip at RTT 0 (the sockets, the
proxy's and the echo's Python), measured in the same run. Two wakers side by side: the
proxy's :class:`~benchmarks.wan_proxy.Clock` and plain ``asyncio.sleep`` (the selector rounds
its waits up to whole milliseconds). Edge-drafted decoding pays one round trip a round, so the
excess is added to every round of the edge modes in ``benchmarks.run``.

``python -m benchmarks.wan_precision [--rtt-ms 5 11 40] [--trips 15] [--out FILE]`` prints a
table and writes JSON. The only guarantee the proxy makes (no round trip under the RTT) is
asserted in ``tests/benchmarks/test_wan_proxy.py``; how far over it is, is measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

from benchmarks.proc_stats import cpu_name
from benchmarks.wan_proxy import LOOPBACK, Clock, WanProxy


class SleepClock:
    """``asyncio.sleep`` until the due time: what the proxy's Clock replaces."""

    async def until(self, due: float) -> None:
        await asyncio.sleep(max(due - time.monotonic(), 0.0))

    def close(self) -> None:
        pass


WAKERS = {"clock": Clock, "asyncio.sleep": SleepClock}


async def echo_server() -> tuple[asyncio.AbstractServer, int]:
    """A loopback server that writes back what it reads, and its port."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, LOOPBACK, 0)
    return srv, srv.sockets[0].getsockname()[1]


async def round_trips(rtt_ms: float, mbps: float, payload: bytes, n: int,
                      waker: str = "clock") -> tuple[list[float], dict]:
    """``n`` sequential round trips of ``payload`` through a fresh proxy: seconds each, proxy stats."""
    srv, port = await echo_server()
    proxy = WanProxy(port, rtt_ms=rtt_ms, mbps=mbps, clock=WAKERS[waker])
    pport = await proxy.start()
    r, w = await asyncio.open_connection(LOOPBACK, pport)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        w.write(payload)
        await w.drain()
        await r.readexactly(len(payload))
        times.append(time.perf_counter() - t0)
    w.write_eof()  # the FIN goes through the proxy and the echo closes: every handler ends
    while await r.read(65536):
        pass
    w.close()
    await proxy.close()
    srv.close()
    return times, proxy.stats()


@dataclass
class PrecisionRow:
    waker: str
    rtt_ms: float
    trips: int
    path_p50_ms: float  # the same round trip at RTT 0
    p50_ms: float
    min_ms: float
    excess_p50_ms: float  # p50 - RTT - path_p50
    excess_max_ms: float  # max - RTT - path_p50


def measure(rtt_ms: float, trips: int, waker: str, payload: bytes = b"w" * 300) -> PrecisionRow:
    """One row: the path at RTT 0 and then ``trips`` round trips at ``rtt_ms``, same waker."""
    base, _ = asyncio.run(round_trips(0.0, 0.0, payload, trips, waker))
    times, _ = asyncio.run(round_trips(rtt_ms, 0.0, payload, trips, waker))
    path = statistics.median(base)
    ms = 1e3
    return PrecisionRow(waker, rtt_ms, trips, round(path * ms, 3), round(statistics.median(times) * ms, 3),
                        round(min(times) * ms, 3), round((statistics.median(times) - rtt_ms / ms - path) * ms, 3),
                        round((max(times) - rtt_ms / ms - path) * ms, 3))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[5.0, 11.0, 40.0])
    ap.add_argument("--trips", type=int, default=15)
    ap.add_argument("--out", default=None, help="JSON file (default: only printed)")
    args = ap.parse_args(argv)
    rows = [measure(rtt, args.trips, waker) for rtt in args.rtt_ms for waker in WAKERS]
    out = {"conditions": {"payload_bytes": 300, "trips": args.trips, "cpus": os.cpu_count(),
                          "cpu": cpu_name(), "loopback": True},
           "rows": [asdict(r) for r in rows]}
    print(f"{'waker':<14} {'RTT ms':>7} {'path p50':>9} {'p50':>8} {'min':>8} {'excess p50':>11} {'excess max':>11}")
    for r in rows:
        print(f"{r.waker:<14} {r.rtt_ms:>7.1f} {r.path_p50_ms:>9.3f} {r.p50_ms:>8.3f} {r.min_ms:>8.3f} "
              f"{r.excess_p50_ms:>11.3f} {r.excess_max_ms:>11.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
