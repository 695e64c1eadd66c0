"""The WAN proxy adds RTT/2 per direction, serialises at the bandwidth cap, and counts bytes."""

import asyncio
import time

import pytest

from benchmarks.wan_proxy import Link, WanProxy


async def _echo_server():
    async def handle(r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def _round_trips(rtt_ms: float, mbps: float, payload: bytes, n: int):
    srv, port = await _echo_server()
    proxy = WanProxy(port, rtt_ms=rtt_ms, mbps=mbps)
    pport = await proxy.start()
    r, w = await asyncio.open_connection("127.0.0.1", pport)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        w.write(payload)
        await w.drain()
        await r.readexactly(len(payload))
        times.append(time.perf_counter() - t0)
    w.close()
    await proxy.close()
    srv.close()
    return times, proxy.stats()


def test_each_round_trip_pays_the_rtt_and_bytes_are_counted_per_direction():
    times, st = asyncio.run(_round_trips(40.0, 0.0, b"x" * 100, 5))
    assert min(times) >= 0.040  # RTT/2 up + RTT/2 down
    assert st["up_bytes"] == 500 and st["down_bytes"] == 500 and st["connections"] == 1


def test_no_delay_at_zero_rtt():
    times, _ = asyncio.run(_round_trips(0.0, 0.0, b"y" * 10, 5))
    assert sorted(times)[2] < 0.030


def test_bandwidth_cap_serialises_large_transfers():
    # 200 kB through an 8 Mbit/s (1 MB/s) link: >= 0.2 s on the uplink (the echo's downlink
    # overlaps it chunk by chunk, as on a real full-duplex link); unlimited: far less
    slow, _ = asyncio.run(_round_trips(0.0, 8.0, b"z" * 200_000, 1))
    fast, _ = asyncio.run(_round_trips(0.0, 0.0, b"z" * 200_000, 1))
    assert slow[0] >= 0.2 and fast[0] < 0.15


def test_link_departures_queue_behind_each_other():
    link = Link(delay_s=0.01, rate_bytes_s=1000.0)
    a = link.departure(0.0, 100)  # 0.1 s on the wire
    b = link.departure(0.0, 100)  # waits for a
    assert abs(a - 0.11) < 1e-9 and abs(b - 0.21) < 1e-9 and link.bytes == 200


@pytest.mark.exclusive  # sub-millisecond timing: run with the machine to itself
def test_a_round_trip_takes_the_rtt_not_a_millisecond_more():
    # held back with asyncio.sleep, which the selector rounds up to whole milliseconds, a round
    # trip at 5.5 ms per direction took 12.4 ms (medians of 15, idle machine). The clock adds
    # 0.1-0.35 ms a direction to what the path itself costs (the same round trip at RTT 0: 0.2-0.4 ms)
    base, _ = asyncio.run(_round_trips(0.0, 0.0, b"w" * 300, 15))
    times, _ = asyncio.run(_round_trips(11.0, 0.0, b"w" * 300, 15))
    assert min(times) >= 0.011
    assert sorted(times)[7] < 0.011 + sorted(base)[7] + 0.0008  # medians (0.2-0.7 ms over on two hosts)
