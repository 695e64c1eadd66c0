"""The router's one-time loads (tokenizer, server drafter) run off its event loop: while one is
in progress the loop keeps serving (other coroutines run on time), and concurrent callers share
the one load (deploy/router/ingress.py, ``Router._load_once``)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from deploy.router.ingress import Router


def test_a_slow_load_does_not_stall_the_loop_and_runs_once():
    RouterClass = Router.func_or_class
    calls = []

    def slow_load():  # e.g. the first import of transformers: seconds on a slow host
        calls.append(threading.current_thread().name)
        time.sleep(0.5)
        return object()

    async def main():
        me = SimpleNamespace(_loaded={}, _load_lock=asyncio.Lock())
        ticks = []

        async def ticker():  # what every other request on the loop needs: turns, on time
            t0 = time.monotonic()
            while time.monotonic() - t0 < 0.45:
                await asyncio.sleep(0.02)
                ticks.append(time.monotonic())

        a, b, _ = await asyncio.gather(RouterClass._load_once(me, "x", slow_load),
                                       RouterClass._load_once(me, "x", slow_load), ticker())
        return a, b, ticks

    a, b, ticks = asyncio.run(main())
    assert a is b and len(calls) == 1 and calls[0] != threading.main_thread().name
    gaps = [t1 - t0 for t0, t1 in zip(ticks, ticks[1:])]
    assert len(ticks) >= 10 and max(gaps) < 0.2  # a load on the loop would stop it for 0.5 s
