"""Sizing: how many edge users a router replica and a verifier replica hold.

A user generating is a closed loop (SpecEdge §4.3): draft ``depth`` forwards, send, wait a
round trip plus the server's time, repeat; between generations a person reads (think time).
So one user offers, on average,

    rounds/s = duty / cycle,   cycle = depth * draft_ms + rtt_ms + server_ms,
    duty     = busy / (busy + think_s),   busy = rounds_per_generation * cycle,
    rounds_per_generation = max_tokens / tokens_per_round,

and a hop that serves ``capacity`` verify rounds per second (measured per core by the load
test: ``summary.json["sizing"]``) holds ``capacity * headroom / rounds_per_user`` users.
Pure module: ``python -m loadtests.sizing SUMMARY.json`` prints the table for the device
profiles and RTTs below from a load-test run's measured rates.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from loadtests.config import DEVICE_DRAFT_MS


@dataclass(frozen=True)
class UserLoad:
    draft_ms: float  # per draft forward
    rtt_ms: float
    depth: int = 4  # draft forwards per round
    server_ms: float = 50.0  # the round's time at the server (queue + forward)
    tokens_per_round: float = 2.5
    max_tokens: int = 256
    think_s: float = 15.0  # a person's pause between generations

    @property
    def cycle_s(self) -> float:
        return (self.depth * self.draft_ms + self.rtt_ms + self.server_ms) / 1000.0

    @property
    def rounds_per_s(self) -> float:
        """Average verify rounds per second one user offers (generating and thinking)."""
        busy = self.max_tokens / self.tokens_per_round * self.cycle_s
        return (busy / (busy + self.think_s)) / self.cycle_s


def users_held(capacity_rounds_per_s: float, load: UserLoad, headroom: float = 0.7) -> int:
    """Users one hop of ``capacity_rounds_per_s`` holds at ``headroom`` of its capacity."""
    return max(0, math.floor(capacity_rounds_per_s * headroom / load.rounds_per_s))


def replicas_needed(users: int, capacity_rounds_per_s: float, load: UserLoad, headroom: float = 0.7) -> int:
    per = users_held(capacity_rounds_per_s, load, headroom)
    return math.ceil(users / per) if per else 0


def table(router_rps: float, verifier_rps: float, rtts=(15.0, 40.0, 80.0), headroom: float = 0.7, **load) -> str:
    lines = ["| device (draft ms/forward) | RTT ms | rounds/s per user | users per router replica (1 core) | "
             "users per verifier replica |", "|---|---|---|---|---|"]
    for device, ms in DEVICE_DRAFT_MS.items():
        for rtt in rtts:
            u = UserLoad(draft_ms=ms, rtt_ms=rtt, **load)
            lines.append(f"| {device} ({ms:g}) | {rtt:g} | {u.rounds_per_s:.3f} | "
                         f"{users_held(router_rps, u, headroom):,} | {users_held(verifier_rps, u, headroom):,} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summary", help="a load test's summary.json (its measured rounds/s per core of each hop)")
    ap.add_argument("--headroom", type=float, default=0.7, help="fraction of measured capacity to plan for")
    ap.add_argument("--think-s", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tokens-per-round", type=float, default=2.5)
    args = ap.parse_args(argv)
    s = json.loads(Path(args.summary).read_text())
    sizing = s["sizing"]
    verifier_rps = s["verify_per_s_window"] / max(s["server"].get("busy_fraction") or 1.0, 1e-9)
    print(f"measured: router {sizing['router']:.0f} rounds/s per core; verifier replica ({s['target']} target) "
          f"{verifier_rps:.0f} rounds/s when busy ({sizing['verifier']:.0f} per core of its process)")
    print(table(sizing["router"], verifier_rps, headroom=args.headroom, think_s=args.think_s,
                max_tokens=args.max_tokens, tokens_per_round=args.tokens_per_round))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
