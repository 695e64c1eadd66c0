"""The router's one-time loads (tokenizer, server drafter) run off its event loop: while one is
in progress the loop keeps serving (other coroutines run on time), and concurrent callers share
the one load (deploy/router/loads.py, ``Loads.once``)."""

from __future__ import annotations

import asyncio
import threading
import time

from deploy.config import AppConfig
from deploy.router.loads import Loads


def test_a_slow_load_does_not_stall_the_loop_and_runs_once():
    calls = []

    def slow_load():  # e.g. the first import of transformers: seconds on a slow host
        calls.append(threading.current_thread().name)
        time.sleep(0.5)
        return object()

    async def main():
        loads = Loads(AppConfig())
        ticks = []

        async def ticker():  # what every other request on the loop needs: turns, on time
            t0 = time.monotonic()
            while time.monotonic() - t0 < 0.45:
                await asyncio.sleep(0.02)
                ticks.append(time.monotonic())

        a, b, _ = await asyncio.gather(loads.once("x", slow_load), loads.once("x", slow_load), ticker())
        return a, b, ticks

    a, b, ticks = asyncio.run(main())
    assert a is b and len(calls) == 1 and calls[0] != threading.main_thread().name
    gaps = [t1 - t0 for t0, t1 in zip(ticks, ticks[1:])]
    assert len(ticks) >= 10 and max(gaps) < 0.2  # a load on the loop would stop it for 0.5 s


HEAVY = ("torch", "transformers", "jinja2", "specdec.sampling", "deploy.router.server_draft")

FRESH_ROUTER = """
import asyncio, importlib.abc, json, sys, threading

from deploy.config import AppConfig
from specdec import openai as oai
from deploy.router.ingress import Router  # noqa: F401  (what a split router replica imports at start)
from deploy.router.loads import Loads

HEAVY = %r
imported_on = {}  # heavy module -> the thread that first imported it

class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in HEAVY and name not in imported_on:
            imported_on[name] = threading.current_thread().name
        return None

assert not [m for m in HEAVY if m in sys.modules], "the split router must not import these at start"
sys.meta_path.insert(0, Spy())

async def main():
    loads = Loads(AppConfig(target={"model": "tiny-random"}))
    await loads.tokenizer()
    await loads.server_drafter()
    loop_thread = threading.current_thread().name
    before = dict(imported_on)
    # what an OpenAI request runs on the loop after those loads: nothing heavy left to import
    oai.check_sampling({"temperature": 0.5, "max_tokens": 4}, 512)
    try:
        oai.chat_prompt([{"role": "user", "content": "hi"}], None)
    except Exception:
        pass
    return loop_thread, before, imported_on

print(json.dumps(asyncio.run(main())))
"""


def test_the_routers_loads_import_torch_and_jinja_off_the_event_loop():
    # the loads themselves ran in a worker thread, but their imports ran on the loop: `from
    # specdec.model.loading import load_tokenizer` before the thread imported torch there (5.5 s
    # on a loaded host: the split soak's 408s). A fresh interpreter, as a split router replica starts
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FRESH_ROUTER % (HEAVY,)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loop_thread, after_loads, after_request = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(after_loads) >= {"torch", "jinja2", "specdec.sampling", "deploy.router.server_draft"}
    assert loop_thread not in after_loads.values(), after_loads
    assert after_request == after_loads  # the request's own steps import nothing heavy on the loop
