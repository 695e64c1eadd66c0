"""DraftExecutor: one thread for the draft forwards of many sessions, critical work first."""

from __future__ import annotations

import asyncio
import threading

import pytest

from edge_agent.draft_executor import CRITICAL, PROACTIVE, DraftExecutor


def test_critical_work_runs_before_queued_proactive_work_fifo_within_a_priority():
    ex = DraftExecutor()
    gate, order = threading.Event(), []
    try:
        blocker = ex.submit(PROACTIVE, gate.wait)  # holds the thread while the queue fills
        futs = [ex.submit(PROACTIVE, order.append, "p1"), ex.submit(CRITICAL, order.append, "c1"),
                ex.submit(PROACTIVE, order.append, "p2"), ex.submit(CRITICAL, order.append, "c2")]
        gate.set()
        for f in [blocker, *futs]:
            f.result(timeout=5)
        assert order == ["c1", "c2", "p1", "p2"]
    finally:
        ex.shutdown()


def test_every_forward_runs_on_one_thread_and_exceptions_reach_the_caller():
    ex = DraftExecutor(name="shared-drafter")
    try:
        names = {ex.submit(CRITICAL, lambda: threading.current_thread().name).result(timeout=5) for _ in range(5)}
        assert names == {"shared-drafter"}
        with pytest.raises(ZeroDivisionError):
            ex.submit(CRITICAL, lambda: 1 / 0).result(timeout=5)
        assert ex.submit(CRITICAL, lambda: 7).result(timeout=5) == 7  # the thread survives it
    finally:
        ex.shutdown()


def test_proactive_work_is_withdrawn_when_the_reply_lands_before_it_starts():
    ex = DraftExecutor()
    gate, ran = threading.Event(), []

    async def main():
        ex.submit(CRITICAL, gate.wait)  # another session's tree holds the thread
        reply = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, reply.set_result, "reply")
        out = await ex.run_until(reply, ran.append, "proactive")
        gate.set()
        return out

    try:
        assert asyncio.run(main()) == (False, None)
        assert ex.submit(CRITICAL, len, ran).result(timeout=5) == 0  # it never ran
    finally:
        ex.shutdown()


def test_a_started_proactive_forward_is_waited_for_and_its_result_returned():
    ex = DraftExecutor()
    started, release = threading.Event(), threading.Event()

    def step():
        started.set()
        release.wait()
        return True

    async def main():
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        task = asyncio.ensure_future(ex.run_until(reply, step))
        await loop.run_in_executor(None, started.wait)
        reply.set_result("reply")  # lands while the forward runs: it holds the draft state, so it finishes
        await asyncio.sleep(0.02)
        assert not task.done()
        release.set()
        return await task

    try:
        assert asyncio.run(main()) == (True, True)
    finally:
        ex.shutdown()


def test_shutdown_withdraws_queued_work_and_refuses_new_work():
    ex = DraftExecutor()
    started, gate = threading.Event(), threading.Event()
    running = ex.submit(CRITICAL, lambda: (started.set(), gate.wait())[1])
    assert started.wait(5)
    queued = ex.submit(PROACTIVE, lambda: "never")
    ex.shutdown()
    gate.set()
    assert running.result(timeout=5) is True  # the forward in progress finishes
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit(CRITICAL, lambda: None)
