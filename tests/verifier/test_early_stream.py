"""deploy/verifier/early_stream.py: early frames from the worker thread to the replica's stream."""

from __future__ import annotations

import asyncio
import threading

import pytest

from deploy.config import EarlyExitConfig
from specdec.errors import InvalidRequest
from specdec.protocol import EarlyFrame, VerifyFrame
from deploy.verifier.early_stream import EarlyStreams, load_heads
from specdec.engine import VerifierEngine
from specdec.exit_heads import EarlyResult


def test_a_replica_without_exit_heads_refuses_the_flag(tiny_model):
    eng = VerifierEngine(tiny_model)
    es = EarlyStreams.attach(eng, EarlyExitConfig(), tiny_model)
    assert eng.exit_heads is None and es.info() == {}
    with pytest.raises(InvalidRequest, match="early"):
        es.accept(VerifyFrame(prefix_len=3, tokens=[1], parents=[-1], early=True))
    assert es.accept(VerifyFrame(prefix_len=3, tokens=[1], parents=[-1])) is False
    on = EarlyStreams.attach(eng, EarlyExitConfig(enabled=True, heads="untrained", layers=[1]), tiny_model)
    assert eng.exit_heads.layers == (1,) and on.info() == {"early_exit_layers": [1]}
    with pytest.raises(FileNotFoundError):
        load_heads(EarlyExitConfig(enabled=True, heads="/nonexistent/heads"), tiny_model)


def test_early_frames_stream_from_another_thread_before_the_reply():
    async def main():
        es = EarlyStreams(heads=object())
        loop = asyncio.get_running_loop()
        reply_at = asyncio.Event()

        async def reply():
            await reply_at.wait()
            return 200, b"reply"

        items = []

        async def consume():
            async for it in es.stream("s1", reply()):
                items.append(it)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        sink = es.sink(loop, ["s1", "other"])
        assert es.sink(loop, ["other"]) is None  # nobody listening: no hook for the batch
        t = threading.Thread(target=sink, args=([EarlyResult("s1", 5, (0, 2), 7, 0.5, 11),
                                                 EarlyResult("other", 5, (), 1, 0.1, 3)],))
        t.start()
        t.join()
        while not items:
            await asyncio.sleep(0.01)
        reply_at.set()
        await task
        assert items[0] == ("early", EarlyFrame(11, 5, [0, 2], 7, 0.5).encode())
        assert items[-1] == ("final", 200, b"reply") and len(items) == 2
        assert es.queues == {}

    asyncio.run(main())
