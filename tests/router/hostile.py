"""Test-side hostile clients and a canary for the serving tests (issue 14).

- :func:`drop_request`: sends a whole HTTP request on a raw socket and closes the
  connection after a delay without reading the answer, as any client timeout does.
- :func:`slow_request`: sends the headers and part of the body, then stalls.
- :class:`Canary`: a healthy session of one tenant generating over and over, in its own
  thread, beside whatever the test does; every output must be exactly the target's
  greedy decoding.
"""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urlsplit

import httpx

from tests.router.oracle_edge import oracle_generate


def _raw(url: str, method: str, path: str, body: bytes, headers: dict, content_length: int | None = None):
    u = urlsplit(url)
    head = [f"{method} {u.path}{path} HTTP/1.1", f"Host: {u.hostname}:{u.port}",
            f"Content-Length: {len(body) if content_length is None else content_length}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    return u.hostname, u.port, ("\r\n".join(head) + "\r\n\r\n").encode()


async def drop_request(url: str, method: str, path: str, body: bytes, headers: dict, delay_s: float) -> None:
    """Send a request, then close the connection after ``delay_s`` without reading the reply."""
    host, port, head = _raw(url, method, path, body, headers)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head + body)
    await writer.drain()
    await asyncio.sleep(delay_s)
    writer.close()


async def slow_request(url: str, path: str, body: bytes, headers: dict, sent: int, timeout_s: float):
    """Declare ``len(body)`` bytes, send only ``sent`` of them, then wait for the answer:
    returns (status line, seconds until the server answered) or (None, timeout_s)."""
    host, port, head = _raw(url, "POST", path, body, headers)
    reader, writer = await asyncio.open_connection(host, port)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    writer.write(head + body[:sent])
    await writer.drain()
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except asyncio.TimeoutError:
        return None, timeout_s
    finally:
        writer.close()
    return line.decode(errors="replace").strip(), loop.time() - t0


class Canary:
    """Generate ``prompt`` greedily, again and again, until :meth:`stop`; each output is
    checked against ``reference`` (exact)."""

    def __init__(self, url: str, key: str, prompt: list[int], reference: list[int], vocab: int):
        self.url, self.key, self.prompt, self.reference, self.vocab = url, key, prompt, reference, vocab
        self.outputs: list[list[int]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=60) as c:
                seed = 0
                while not self._stop.is_set():
                    out, _ = await oracle_generate(c, self.prompt, self.reference,
                                                   {"max_tokens": len(self.reference)}, self.vocab, seed=seed,
                                                   key=self.key)
                    self.outputs.append(out)
                    seed += 1
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def __enter__(self) -> "Canary":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the canary hung"
        if exc[0] is None:
            self.check()

    def check(self) -> None:
        assert self.error is None, f"canary failed: {self.error!r}"
        assert self.outputs, "the canary finished no generation"
        assert all(o == self.reference for o in self.outputs), "the canary's output changed"
