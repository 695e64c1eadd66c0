"""The WAN proxy adds RTT/2 per direction, serialises at the bandwidth cap, and counts bytes.

Only what the proxy guarantees is asserted here (nothing arrives before its time, departures
queue at the cap); how far over the RTT a round trip runs is measured by
``python -m benchmarks.wan_precision``."""

import asyncio
import time
from types import SimpleNamespace

import benchmarks.wan_proxy as wan_proxy
from benchmarks.wan_precision import round_trips
from benchmarks.wan_proxy import Clock, Link


def test_each_round_trip_pays_the_rtt_and_bytes_are_counted_per_direction():
    times, st = asyncio.run(round_trips(40.0, 0.0, b"x" * 100, 5))
    assert min(times) >= 0.040  # RTT/2 up + RTT/2 down
    assert st["up_bytes"] == 500 and st["down_bytes"] == 500 and st["connections"] == 1


def test_at_zero_rtt_bytes_go_through_unchanged_and_are_not_held():
    times, st = asyncio.run(round_trips(0.0, 0.0, b"y" * 10, 5))
    assert len(times) == 5 and st["up_bytes"] == st["down_bytes"] == 50
    link = Link(delay_s=0.0)
    assert link.departure(12.5, 1000) == 12.5 and link.departure(12.5, 1000) == 12.5  # no queue without a cap


def test_bandwidth_cap_serialises_large_transfers():
    # 200 kB through an 8 Mbit/s (1 MB/s) link: >= 0.2 s on the uplink (the echo's downlink
    # overlaps it chunk by chunk, as on a real full-duplex link)
    slow, st = asyncio.run(round_trips(0.0, 8.0, b"z" * 200_000, 1))
    assert slow[0] >= 0.2 and st["up_bytes"] == st["down_bytes"] == 200_000


def test_link_departures_queue_behind_each_other():
    link = Link(delay_s=0.01, rate_bytes_s=1000.0)
    a = link.departure(0.0, 100)  # 0.1 s on the wire
    b = link.departure(0.0, 100)  # waits for a
    c = link.departure(0.5, 100)  # the link is idle again by 0.5 s
    assert abs(a - 0.11) < 1e-9 and abs(b - 0.21) < 1e-9 and abs(c - 0.61) < 1e-9 and link.bytes == 300


def test_the_clock_never_wakes_a_waiter_before_its_time_even_when_let_go_early():
    async def waits():
        clock = Clock()
        early = []
        try:
            for i in range(20):
                clock.lead_s = Clock.MAX_LEAD_S  # the thread lets go 2 ms early: the loop must spin the rest
                due = time.monotonic() + 0.003 + 0.0005 * (i % 3)
                await clock.until(due)
                early.append(time.monotonic() < due)
            await clock.until(time.monotonic() - 1.0)  # a time already past returns at once
        finally:
            clock.close()
        return early

    assert not any(asyncio.run(waits()))


def test_the_lead_is_the_least_hand_over_delay_of_the_window_capped(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(wan_proxy, "time", SimpleNamespace(monotonic=lambda: now[0]))
    clock = Clock()
    try:
        loop = asyncio.new_event_loop()

        def wake(delay_s: float) -> None:  # the loop ran the wake-up delay_s after the planned let-go
            fut = loop.create_future()
            clock._wake(fut, now[0], now[0] - delay_s)
            assert fut.done()

        for d in (0.0009, 0.0004, 0.0007):
            wake(d)
        assert abs(clock.lead_s - 0.0004) < 1e-12
        for _ in range(Clock.WINDOW):  # the 0.4 ms leaves the window
            wake(0.005)
        assert clock.lead_s == Clock.MAX_LEAD_S  # capped
        wake(0.0001)
        assert abs(clock.lead_s - 0.0001) < 1e-12
        loop.close()
    finally:
        clock.close()
