"""The in-process verifier handle (topology colocated): the router's two call forms, and
cancellation reaching the verifier's coroutine as Serve's would."""

from __future__ import annotations

import asyncio

import pytest

from deploy.router.early import stream_verify
from deploy.router.in_process import InProcessVerifier


class Replica:
    """Stands in for VerifierDeployment: records what it was asked and whether it was cancelled."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.cancelled = asyncio.Event()
        self.waiting = asyncio.Event()

    async def verify(self, session_id: str, tenant: str, frame: bytes):
        self.calls.append(("verify", session_id, tenant, frame))
        return 200, frame[::-1]

    async def verify_stream(self, session_id: str, tenant: str, frame: bytes):
        for i in range(3):
            yield ("early", bytes([i]))
        yield ("final", 200, frame)

    async def hang(self):
        self.waiting.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    def _internal(self):
        raise AssertionError("never reachable through the handle")


def test_a_call_awaits_the_replica_method_with_its_arguments():
    async def main():
        r = Replica()
        out = await InProcessVerifier(r).verify.remote(session_id="s.1", tenant="t", frame=b"abc")
        return r, out

    r, out = asyncio.run(main())
    assert out == (200, b"cba") and r.calls == [("verify", "s.1", "t", b"abc")]


def test_a_streaming_call_forwards_early_frames_then_returns_the_reply():
    sent: list[bytes] = []

    async def send(b: bytes):
        sent.append(b)

    out = asyncio.run(stream_verify(InProcessVerifier(Replica()), "verify_stream", send,
                                    {"session_id": "s.1", "tenant": "t", "frame": b"xyz"}))
    assert out == (200, b"xyz") and sent == [b"\x00", b"\x01", b"\x02"]


def test_cancelling_the_caller_cancels_the_verifier_coroutine():
    async def main():
        r = Replica()
        task = asyncio.ensure_future(InProcessVerifier(r).hang.remote())
        await r.waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return r.cancelled.is_set()

    assert asyncio.run(main())


def test_a_timeout_cancels_the_verifier_coroutine():
    async def main():
        r = Replica()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(InProcessVerifier(r).hang.remote(), 0.05)
        return r.cancelled.is_set()

    assert asyncio.run(main())


def test_private_members_and_unknown_methods_are_not_callable():
    h = InProcessVerifier(Replica())
    with pytest.raises(AttributeError):
        h._internal
    with pytest.raises(AttributeError):
        h.no_such_method
    assert h.options(stream=True) is h
