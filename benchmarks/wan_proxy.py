"""A user-space WAN emulator: a delaying TCP proxy (the kernel here has no ``netem``).

Every byte that crosses the proxy is held back ``rtt_ms / 2`` in each direction
(propagation), and, with a bandwidth cap, also serialised at ``mbps`` per direction
(transmission: a chunk of ``n`` bytes occupies the link for ``8 n / rate`` seconds, so
back-to-back chunks queue behind each other). Order within a connection is kept.
It counts the bytes that cross it per direction (TCP payload, i.e. HTTP headers
included), which is what the benchmarks report as uplink/downlink bytes.

Loopback only: it listens on 127.0.0.1 and forwards to a 127.0.0.1 port.

Each direction of a connection is a reader thread and a writer thread on blocking sockets:
the writer sleeps until a chunk's time (``time.sleep``: ~0.1 ms late here) and sends it.
The asyncio version before it held chunks back with ``asyncio.sleep``, which the selector
rounds up to whole milliseconds: with an echo server behind it (300-byte messages, idle
machine) a round trip took 16.86 ms at ``--rtt-ms 15`` and 0.16 ms at 0, i.e. 1.7 ms more
than asked. Edge-drafted decoding pays one round trip per round, a streaming server the RTT
once, so that error fell on one side of the comparison.

``python -m benchmarks.wan_proxy --target-port 8123 --rtt-ms 50 [--mbps 10] [--port 0]
[--stats-file F]`` prints ``LISTENING <port>`` once ready and keeps ``F`` updated with
``{"up_bytes", "down_bytes", "connections"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue

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


@dataclass
class WanProxy:
    target_port: int
    rtt_ms: float = 0.0
    mbps: float = 0.0  # per direction; 0 = unlimited
    port: int = 0
    connections: int = 0
    up: Link = field(init=False)
    down: Link = field(init=False)

    def __post_init__(self):
        rate = self.mbps * 1e6 / 8 if self.mbps > 0 else 0.0
        # one shared link per direction: concurrent connections compete for its bandwidth
        self.up = Link(self.rtt_ms / 2e3, rate)
        self.down = Link(self.rtt_ms / 2e3, rate)
        self._links = threading.Lock()  # departures are computed under it: the links are shared
        self._listener: socket.socket | None = None
        self._closed = threading.Event()

    def stats(self) -> dict:
        return {"up_bytes": self.up.bytes, "down_bytes": self.down.bytes, "connections": self.connections,
                "rtt_ms": self.rtt_ms, "mbps": self.mbps}

    async def start(self) -> int:
        """Listen and serve on threads of this process; returns the port."""
        self._listener = socket.create_server((LOOPBACK, self.port))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="wan-proxy-accept", daemon=True).start()
        return self.port

    async def close(self) -> None:
        """Stop accepting (open connections run on until either end closes)."""
        self._closed.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
            except OSError:
                pass
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection((LOOPBACK, self.target_port))
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pumps = [threading.Thread(target=self._pump, args=(a, b, link), daemon=True)
                 for a, b, link in ((client, server, self.up), (server, client, self.down))]
        for t in pumps:
            t.start()
        for t in pumps:
            t.join()
        for s in (client, server):
            s.close()

    def _pump(self, src: socket.socket, dst: socket.socket, link: Link) -> None:
        """Read ``src`` as bytes arrive and hand each chunk to a writer that sends it at its time."""
        queue: SimpleQueue = SimpleQueue()
        writer = threading.Thread(target=self._deliver, args=(queue, src, dst), daemon=True)
        writer.start()
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            now = time.monotonic()
            if not data:
                queue.put((now + link.delay_s, None))  # the FIN travels with the same delay
                break
            with self._links:
                due = link.departure(now, len(data))
            queue.put((due, data))
        writer.join()

    @staticmethod
    def _deliver(queue: SimpleQueue, src: socket.socket, dst: socket.socket) -> None:
        while True:
            due, data = queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if data is None:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:  # the far end went: stop reading the near one too
                try:
                    src.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
                return


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
