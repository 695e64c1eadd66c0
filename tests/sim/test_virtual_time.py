"""sim/virtual_time.py: sleeps, timeouts and worker tasks take virtual time only."""

from __future__ import annotations

import asyncio

import pytest

from sim.virtual_time import SharedCores, Stalled, VirtualClock, VirtualWorker, bursts, run
from specdec import clock


def test_an_hour_of_sleeps_ends_on_the_virtual_hour_in_order():
    order = []

    async def sleeper(name: str, seconds: float):
        await clock.sleep(seconds)
        order.append((name, clock.monotonic()))

    async def main():
        await asyncio.gather(sleeper("b", 3600.0), sleeper("a", 1.5), sleeper("c", 3600.0))
        return clock.monotonic(), clock.wall()

    now, wall = run(main())
    assert order == [("a", 1.5), ("b", 3600.0), ("c", 3600.0)] and now == 3600.0 and wall > 1.7e9


def test_wait_for_times_out_in_virtual_time():
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), timeout=30.0)
        return clock.monotonic()

    assert run(main()) == pytest.approx(30.0)


def test_worker_tasks_run_in_order_and_take_what_they_spend():
    vc = VirtualClock()
    seen = []

    def work(name: str, seconds: float):
        seen.append((name, "start", clock.monotonic()))
        vc.spend(seconds)
        seen.append((name, "end", clock.monotonic()))
        return name

    async def main():
        w = VirtualWorker(asyncio.get_running_loop())
        loop = asyncio.get_running_loop()
        a = loop.run_in_executor(w, work, "a", 0.25)
        b = loop.run_in_executor(w, work, "b", 0.5)
        ticks = []

        async def ticker():  # the loop keeps its turns while the worker works
            for _ in range(5):
                await clock.sleep(0.1)
                ticks.append(round(clock.monotonic(), 6))

        results = await asyncio.gather(a, b, ticker())
        return results[:2], ticks, clock.monotonic(), w.busy_seconds

    out, ticks, now, busy = run(main(), vc)
    assert out == ["a", "b"] and seen == [("a", "start", 0.0), ("a", "end", 0.25), ("b", "start", 0.25),
                                          ("b", "end", 0.75)]
    assert ticks == [0.1, 0.2, 0.3, 0.4, 0.5] and now == pytest.approx(0.75) and busy == pytest.approx(0.75)


def test_a_worker_tasks_cpu_reads_differ_by_what_it_spent_on_shared_cores():
    """clock.thread_time() in a worker task: its own CPU (a forward's cpu_seconds), not the seconds it took
    while another process shared the core, nor the simulator's CPU."""
    vc = VirtualClock()

    def work(seconds: float):
        t0, c0 = clock.perf_counter(), clock.thread_time()
        vc.spend(seconds)
        return clock.perf_counter() - t0, clock.thread_time() - c0

    async def main():
        loop = asyncio.get_running_loop()
        cores = SharedCores(loop, 1.0)
        a, b = VirtualWorker(loop, cores), VirtualWorker(loop, cores)
        out = await asyncio.gather(loop.run_in_executor(a, work, 0.5), loop.run_in_executor(b, work, 0.5))
        return out, clock.thread_time()

    (a, b), total = run(main(), vc)
    assert (a[1], b[1]) == pytest.approx((0.5, 0.5)) and max(a[0], b[0]) == pytest.approx(1.0)  # b waited on a
    assert total == pytest.approx(1.0)


def test_a_worker_error_reaches_the_caller():
    def boom():
        raise ValueError("x")

    async def main():
        with pytest.raises(ValueError):
            await asyncio.get_running_loop().run_in_executor(VirtualWorker(asyncio.get_running_loop()), boom)
        return True

    assert run(main())


def test_spending_outside_a_worker_is_refused():
    with pytest.raises(RuntimeError):
        VirtualClock().spend(1.0)


def test_a_deadlock_is_reported_not_hung(monkeypatch):
    monkeypatch.setattr("sim.virtual_time.REAL_WAIT_S", 0.05)
    with pytest.raises(Stalled):
        run(asyncio.Event().wait())


def _shared(cores: float, jobs: list[tuple[float, float]], weights: list[float] | None = None):
    """Each job ``(start, cpu_seconds)`` on a worker of its own (of ``weights``, default 1 each),
    sharing ``cores``: when each finishes, what its own clock read inside, and the CPU seconds the
    workers count."""
    vc = VirtualClock()
    inside = []

    def work(seconds: float):
        t0 = clock.monotonic()
        vc.spend(seconds)
        inside.append(round(clock.monotonic() - t0, 9))

    async def job(shared, start: float, seconds: float, weight: float):
        await clock.sleep(start)
        w = VirtualWorker(asyncio.get_running_loop(), shared, weight)
        await asyncio.get_running_loop().run_in_executor(w, work, seconds)
        return round(clock.monotonic(), 9), w.busy_seconds

    async def main():
        shared = SharedCores(asyncio.get_running_loop(), cores)
        return await asyncio.gather(*(job(shared, t, s, k) for (t, s), k in zip(jobs, weights or [1.0] * len(jobs))))

    out = run(main(), vc)
    return [t for t, _ in out], inside, [b for _, b in out]


def test_processes_share_the_cores_equally_at_most_a_core_each():
    ends, _, busy = _shared(1.0, [(0.0, 1.0), (0.0, 1.0)])
    assert ends == [2.0, 2.0] and busy == pytest.approx([1.0, 1.0])  # two on one core: half each
    ends, _, _ = _shared(2.0, [(0.0, 1.0), (0.0, 1.0), (0.0, 1.0)])
    assert ends == [1.5, 1.5, 1.5]  # three on two cores: two thirds each
    ends, _, _ = _shared(2.0, [(0.0, 1.0), (0.0, 0.5)])
    assert ends == [1.0, 0.5]  # fewer processes than cores: a whole core each, no faster


def test_processes_share_the_cores_by_weight_at_most_a_core_each():
    ends, inside, _ = _shared(1.0, [(0.0, 1.0), (0.0, 1.0)], [1.0, 3.0])
    assert ends == [2.0, pytest.approx(4 / 3)]  # three quarters of the core to the heavy one, then all to the other
    assert inside == [1.0, pytest.approx(4 / 3)]  # the heavy one's clock counts the other's quarter (the first,
    # started alone, could not know)
    ends, _, _ = _shared(2.0, [(0.0, 1.0), (0.0, 1.0), (0.0, 1.0)], [3.0, 1.0, 1.0])
    assert ends == [1.0, 1.5, 1.5]  # the heavy one capped at a core, the other core split; then a core each
    ends, _, _ = _shared(1.0, [(0.0, 1.0), (0.0, 1.0)], [1.0, 1.0])
    assert ends == [2.0, 2.0]  # equal weights: equal shares, as without


def test_a_worker_without_a_positive_weight_is_refused():
    async def main():
        VirtualWorker(asyncio.get_running_loop(), None, 0.0)

    with pytest.raises(ValueError, match="weight"):
        run(main(), VirtualClock())


def test_a_task_that_arrives_slows_the_running_one_from_then_on():
    # a: 2 s of CPU from 0; b: 0.5 s from 0.5. a runs alone until 0.5 (1.5 s left), both at half a
    # core until b is done at 1.5 (a has 1.0 left), then a alone: done at 2.5
    ends, inside, _ = _shared(1.0, [(0.0, 2.0), (0.5, 0.5)])
    assert ends == [2.5, 1.5]
    assert inside == [2.0, 1.0]  # b's own clock counts what a still needed when b started, up to b's own


def test_a_tasks_clock_counts_only_what_the_others_still_need_when_it_starts():
    # a: 0.1 s of CPU from 0; b: 1.0 s from 0: b's clock counts a's 0.1 s, not half a core throughout
    # (a's own clock, started alone, reads 0.1: it could not know)
    ends, inside, _ = _shared(1.0, [(0.0, 0.1), (0.0, 1.0)])
    assert ends == [0.2, 1.1] and inside == [0.1, 1.1]


def test_a_workers_clock_learns_the_slowdown_of_work_that_keeps_arriving():
    """Another process with a short task every 50 ms: a worker's 1-s tasks take about 2 s each;
    its first task's clock reads at most 1.05 s (what it knew at its start), its later ones close to 2 s."""
    vc = VirtualClock()
    inside = []

    def work():
        t0 = clock.monotonic()
        vc.spend(1.0)
        inside.append(clock.monotonic() - t0)

    async def main():
        loop = asyncio.get_running_loop()
        shared = SharedCores(loop, 1.0)
        w, other = VirtualWorker(loop, shared), VirtualWorker(loop, shared)

        async def stream():
            while True:
                await loop.run_in_executor(other, vc.spend, 0.05)

        s = asyncio.ensure_future(stream())
        for _ in range(12):
            await loop.run_in_executor(w, work)
        s.cancel()
        return w.slowdown

    slowdown = run(main(), vc)
    assert inside[0] <= 1.05 + 1e-9 and 1.8 < slowdown < 2.1 and 1.7 < inside[-1] < 2.1


def test_a_blocking_sleep_in_a_worker_takes_its_time():
    vc = VirtualClock()

    def work():
        t0 = clock.monotonic()
        clock.blocking_sleep(0.3)
        return clock.monotonic() - t0

    async def main():
        return await asyncio.get_running_loop().run_in_executor(VirtualWorker(asyncio.get_running_loop()), work)

    assert run(main(), vc) == pytest.approx(0.3)


def test_shared_cores_refuse_a_non_positive_count():
    async def main():
        SharedCores(asyncio.get_running_loop(), 0.0)

    with pytest.raises(ValueError, match="cores"):
        run(main())


def test_another_processes_bursts_take_their_cores_while_they_last():
    """1 s of CPU on one core, another process taking half of it from 0.5 s for 0.5 s every 10 s:
    0.5 s of CPU by 0.5, 0.25 more by 1.0 (half a core), the last 0.25 by 1.25; the next burst,
    from 10.5, costs a task started there as much again."""
    vc = VirtualClock()

    async def main():
        loop = asyncio.get_running_loop()
        shared = SharedCores(loop, 1.0)
        b = asyncio.ensure_future(bursts(shared, 0.5, 0.5, 10.0, 0.5))
        w = VirtualWorker(loop, shared)
        await loop.run_in_executor(w, vc.spend, 1.0)
        first = clock.monotonic()
        await clock.sleep(10.5 - first)
        await loop.run_in_executor(w, vc.spend, 1.0)
        second = clock.monotonic()
        b.cancel()
        return first, second, shared.cores

    first, second, cores = run(main(), vc)
    assert first == pytest.approx(1.25) and second == pytest.approx(10.5 + 1.25) and cores == 1.0
    with pytest.raises(ValueError, match="cores"):
        SharedCores.set_cores(None, 0.0)
