"""A user-space WAN emulator: a delaying TCP proxy (the kernel here has no ``netem``).

Every byte that crosses the proxy is held back ``rtt_ms / 2`` in each direction
(propagation), and, with a bandwidth cap, also serialised at ``mbps`` per direction
(transmission: a chunk of ``n`` bytes occupies the link for ``8 n / rate`` seconds, so
back-to-back chunks queue behind each other). Order within a connection is kept.
It counts the bytes that cross it per direction (TCP payload, i.e. HTTP headers
included), which is what the benchmarks report as uplink/downlink bytes.

Loopback only: it listens on 127.0.0.1 and forwards to a 127.0.0.1 port.

Chunks are held back by :class:`Clock`, a thread that wakes the event loop at each chunk's
time, not by ``asyncio.sleep``: the selector rounds its waits up to whole milliseconds, so
with ``asyncio.sleep`` every chunk left up to 1 ms late. Edge-drafted decoding pays one round
trip per round, a streaming server the RTT once per request, so that error falls on one side
of the comparison. ``python -m benchmarks.wan_precision`` measures both wakers side by side
(figures in docs/benchmarks.md).

``python -m benchmarks.wan_proxy --target-port 8123 --rtt-ms 50 [--mbps 10] [--port 0]
[--stats-file F]`` prints ``LISTENING <port>`` once ready and keeps ``F`` updated with
``{"up_bytes", "down_bytes", "connections"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import heapq
import itertools
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

LOOPBACK = "127.0.0.1"


@dataclass
class Link:
    """One direction of the emulated WAN: delay + optional rate limit."""

    delay_s: float
    rate_bytes_s: float = 0.0  # 0 = unlimited
    busy_until: float = 0.0  # when the transmitter is free again (monotonic)
    bytes: int = 0

    def departure(self, now: float, n: int) -> float:
        """When a chunk of ``n`` bytes read at ``now`` arrives at the far end."""
        self.bytes += n
        if self.rate_bytes_s > 0:
            start = max(now, self.busy_until)
            self.busy_until = start + n / self.rate_bytes_s
            return self.busy_until + self.delay_s
        return now + self.delay_s


class Waker(Protocol):
    """What the proxy holds chunks back with: ``until(due)`` returns at or after ``due``."""

    async def until(self, due: float) -> None: ...

    def close(self) -> None: ...


class Clock:
    """Wakes coroutines at a monotonic time (``asyncio.sleep``: up to 1 ms late).

    One daemon thread keeps a heap of due times and sleeps on a condition until the earliest;
    then it resolves the waiting future through the loop's thread-safe wake-up, which the
    selector sees at once (a file descriptor turns readable: no rounded timeout). The thread's
    wake-up and the hand-over to the loop take time of their own (0.15-0.35 ms on one host,
    ~0.4 ms on another), so the thread lets each item go that much early: the lead is the least
    delay from the planned let-go to the loop running the wake-up over the last ``WINDOW`` items
    (capped at ``MAX_LEAD_S``), and the wake-up spins the remainder (a few microseconds) on the
    loop, so nothing runs before its time."""

    WINDOW = 32
    MAX_LEAD_S = 0.002

    def __init__(self):
        self._heap: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._delays: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self.lead_s = 0.0
        self._thread = threading.Thread(target=self._run, name="wan-proxy-clock", daemon=True)
        self._thread.start()

    async def until(self, due: float) -> None:
        """Return at ``time.monotonic() >= due`` (the default event loop's ``loop.time()``)."""
        if due <= time.monotonic():
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            heapq.heappush(self._heap, (due, next(self._seq), loop, fut))
            self._cv.notify()
        await fut

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if not self._heap:
                    self._cv.wait()
                    continue
                wait = self._heap[0][0] - self.lead_s - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                due, _, loop, fut = heapq.heappop(self._heap)
                try:  # planned to let go at due - lead (the condition wakes late too)
                    loop.call_soon_threadsafe(self._wake, fut, due, max(due - self.lead_s, 0.0))
                except RuntimeError:  # that loop is closed: nobody waits any more
                    pass

    def _wake(self, fut: asyncio.Future, due: float, let_go: float) -> None:
        now = time.monotonic()
        self._delays.append(max(now - let_go, 0.0))
        self.lead_s = min(min(self._delays), self.MAX_LEAD_S)
        while now < due:  # let go early by the lead: at most a few microseconds to spin
            now = time.monotonic()
        if not fut.done():
            fut.set_result(None)


@dataclass
class WanProxy:
    target_port: int
    rtt_ms: float = 0.0
    mbps: float = 0.0  # per direction; 0 = unlimited
    port: int = 0
    clock: Callable[[], Waker] = Clock  # benchmarks.wan_precision compares asyncio.sleep's
    connections: int = 0
    up: Link = field(init=False)
    down: Link = field(init=False)

    def __post_init__(self):
        rate = self.mbps * 1e6 / 8 if self.mbps > 0 else 0.0
        # one shared link per direction: concurrent connections compete for its bandwidth
        self.up = Link(self.rtt_ms / 2e3, rate)
        self.down = Link(self.rtt_ms / 2e3, rate)
        self._server: asyncio.AbstractServer | None = None
        self._clock: Waker | None = None

    def stats(self) -> dict:
        return {"up_bytes": self.up.bytes, "down_bytes": self.down.bytes, "connections": self.connections,
                "rtt_ms": self.rtt_ms, "mbps": self.mbps}

    async def start(self) -> int:
        self._clock = self.clock()
        self._server = await asyncio.start_server(self._handle, LOOPBACK, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._clock is not None:
            self._clock.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                await self._clock.until(due)
                if data is None:
                    break
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        task = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                queue.put_nowait((link.departure(loop.time(), len(data)), data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((loop.time() + link.delay_s, None))  # the FIN travels with the same delay
        try:
            await task
        except (ConnectionError, OSError):
            pass

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            s_reader, s_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(self._pump(c_reader, s_writer, self.up), self._pump(s_reader, c_writer, self.down))
        finally:
            for w in (s_writer, c_writer):
                w.close()


async def _serve(args) -> None:
    proxy = WanProxy(args.target_port, args.rtt_ms, args.mbps, args.port)
    port = await proxy.start()
    print(f"LISTENING {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def dump():
        if args.stats_file:
            tmp = Path(args.stats_file + ".tmp")
            tmp.write_text(json.dumps(dict(proxy.stats(), time=time.time())))
            os.replace(tmp, args.stats_file)

    while not stop.is_set():
        dump()
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
    dump()
    await proxy.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-port", type=int, required=True)
    ap.add_argument("--rtt-ms", type=float, default=0.0)
    ap.add_argument("--mbps", type=float, default=0.0, help="bandwidth cap per direction (0 = none)")
    ap.add_argument("--port", type=int, default=0, help="listen port (0 = a free one)")
    ap.add_argument("--stats-file", default=None)
    asyncio.run(_serve(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
