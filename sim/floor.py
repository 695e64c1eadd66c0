"""The floor under any simulation that runs the production asyncio code in one process (issue 61):
the virtual-time event loop's own cost per round, with the fewest events a served round takes and
no production code at all.

A bare round: the user's request crosses half its RTT, wakes its replica's batch loop and waits on
a future; the loop takes every request waiting, spends one forward on its virtual worker and answers
them; the reply crosses the other half. Whatever the production router, verifier and edge add comes
on top, so rounds / (this many per wall second) bounds a simulation's wall time from below.
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass

from sim.virtual_time import VirtualClock, VirtualTimeLoop, VirtualWorker, run
from specdec import clock


@dataclass(frozen=True)
class Floor:
    users: int
    replicas: int
    rounds: int
    wall_s: float
    simulated_s: float
    forwards: int

    @property
    def us_per_round(self) -> float:
        return 1e6 * self.wall_s / max(self.rounds, 1)

    def wall_for(self, rounds: float) -> float:
        """Wall seconds the bare loop alone needs for ``rounds``."""
        return rounds * self.us_per_round / 1e6


class _BareReplica:
    """A batch loop and nothing else: every waiting request goes into the next forward."""

    def __init__(self, loop: VirtualTimeLoop, forward_s: float):
        self.worker, self.forward_s = VirtualWorker(loop), forward_s
        self.waiting: list[asyncio.Future] = []
        self.wake = asyncio.Event()
        self.forwards = 0

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.waiting = self.waiting, []
            self.forwards += 1
            await loop.run_in_executor(self.worker, clock.blocking_sleep, self.forward_s)
            for fut in batch:
                fut.set_result(None)

    async def call(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self.wake.set()
        await fut


async def _users(users: int, replicas: int, rounds: int, rtt_s: float, forward_s: float) -> int:
    """The forwards the replicas ran."""
    loop = asyncio.get_running_loop()
    fleet = [_BareReplica(loop, forward_s) for _ in range(replicas)]
    loops = [asyncio.ensure_future(r.serve()) for r in fleet]

    async def user(i: int) -> None:
        await clock.sleep(rtt_s * (i % 97) / 97)  # spread, as spawning does
        for _ in range(rounds):
            await clock.sleep(rtt_s / 2)
            await fleet[i % replicas].call()
            await clock.sleep(rtt_s / 2)

    await asyncio.gather(*(user(i) for i in range(users)))
    for t in loops:
        t.cancel()
    return sum(r.forwards for r in fleet)


def measure(users: int = 5000, replicas: int = 66, rounds: int = 20, rtt_s: float = 0.04,
            forward_s: float = 0.02) -> Floor:
    """``users`` bare users, ``rounds`` rounds each, over ``replicas`` bare batch loops."""
    t0, vc = time.perf_counter(), VirtualClock()
    forwards = run(_users(users, replicas, rounds, rtt_s, forward_s), vc)
    return Floor(users, replicas, users * rounds, time.perf_counter() - t0, vc.now, forwards)


def add_parser(sub) -> None:
    p = sub.add_parser("floor", help="the event loop's own cost per round: the floor under any simulation's wall time")
    p.add_argument("--users", type=int, default=5000)
    p.add_argument("--replicas", type=int, default=66)
    p.add_argument("--rounds", type=int, default=20, help="per user")
    p.add_argument("--for-users", type=int, default=100_000, help="the workload to bound: its users ...")
    p.add_argument("--for-s", type=float, default=600.0, help="... its simulated seconds ...")
    p.add_argument("--rounds-per-user-s", type=float, default=None,
                   help="... and its verify rounds per user-second (a run's verify_rounds_per_s / users)")


def main(args) -> int:
    gc.freeze()  # the imports' heap (torch's) out of the collector's way: the floor at its lowest
    f = measure(args.users, args.replicas, args.rounds)
    print(f"bare rounds: {f.rounds} ({f.users} users, {f.replicas} replicas) in {f.wall_s:.2f} s of wall time: "
          f"{f.us_per_round:.1f} us a round, {1e6 / f.us_per_round:,.0f} rounds a second")
    if args.rounds_per_user_s:
        rounds = args.for_users * args.for_s * args.rounds_per_user_s
        print(f"{args.for_users:,} users x {args.for_s:g} s x {args.rounds_per_user_s:g} rounds a user-second = "
              f"{rounds:,.0f} rounds: at least {f.wall_for(rounds):,.0f} s of wall time on this core")
    return 0
