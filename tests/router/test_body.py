"""Request bodies at the router (deploy/router/body.py): bounded in size and time, strict JSON."""

from __future__ import annotations

import asyncio

import pytest

from deploy.router.body import json_object, parse_json, read_body
from specdec.errors import InvalidRequest, PayloadTooLarge, RequestTimeout


class FakeRequest:
    """What read_body uses of a Starlette request: its headers and its body as chunks."""

    def __init__(self, chunks: list[bytes], content_length: str | None = None, delay_s: float = 0.0):
        self.headers = {} if content_length is None else {"content-length": content_length}
        self.chunks, self.delay_s = chunks, delay_s

    async def stream(self):
        for c in self.chunks:
            await asyncio.sleep(self.delay_s)
            yield c


def read(request: FakeRequest, max_bytes: int = 10, timeout_s: float = 1.0) -> bytes:
    return asyncio.run(read_body(request, max_bytes, timeout_s))


def test_a_body_within_its_limits_is_read_whole():
    assert read(FakeRequest([b"abc", b"def"], "6")) == b"abcdef"
    assert read(FakeRequest([])) == b""


@pytest.mark.parametrize("request_,error", [
    (FakeRequest([b"x"], "11"), PayloadTooLarge),  # declared too large: refused before reading
    (FakeRequest([b"x"], "ten"), InvalidRequest),
    (FakeRequest([b"123456", b"123456"]), PayloadTooLarge),  # no Content-Length: cut as it grows
    (FakeRequest([b"1", b"2"], delay_s=0.2), RequestTimeout),
])
def test_bodies_over_their_limits_are_refused(request_, error):
    with pytest.raises(error):
        read(request_, timeout_s=0.3)


@pytest.mark.parametrize("body", [b"NaN", b'{"t": Infinity}', b"[" * 100_000 + b"]" * 100_000, b"{", b"\xff"])
def test_strict_json_refuses_what_python_would_take_or_choke_on(body):
    with pytest.raises(InvalidRequest):
        parse_json(body)


def test_json_object():
    assert json_object(b'{"a": 1}') == {"a": 1}
    assert parse_json(b"") is None
    with pytest.raises(InvalidRequest):
        json_object(b"[1]")
