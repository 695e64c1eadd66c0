"""specdec/clock.py: the one clock seam; no module of the three packages reads the host's clocks
or sleeps past it (issue 61)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from specdec import clock

ROOT = Path(__file__).resolve().parents[2]
DIRECT = re.compile(r"\btime\.(monotonic|perf_counter|time|sleep|thread_time)\b|\basyncio\.sleep\b")


class Frozen:
    def __init__(self, t: float):
        self.t = t

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1e9 + self.t

    def blocking_sleep(self, seconds: float) -> None:
        self.t += seconds

    def thread_time(self) -> float:
        return 2 * self.t


def _reads_the_host() -> bool:
    """The seam's reads fall between two reads of the host's own clocks."""
    t0, w0 = time.monotonic(), time.time()
    m, w = clock.monotonic(), clock.wall()
    return t0 <= m <= time.monotonic() and w0 <= w <= time.time()


def test_real_by_default_and_swapped_within_use():
    assert isinstance(clock.current(), clock.RealClock) and _reads_the_host()
    with clock.use(Frozen(5.0)) as f:
        assert clock.monotonic() == clock.perf_counter() == 5.0 and clock.wall() == 1e9 + 5.0
        clock.blocking_sleep(2.0)
        assert clock.monotonic() == 7.0 and clock.thread_time() == 14.0 and clock.current() is f
    assert isinstance(clock.current(), clock.RealClock) and _reads_the_host()


def test_sleep_is_asyncio_sleep():
    assert asyncio.run(clock.sleep(0, "x")) == "x"


def test_no_direct_clock_reads_in_the_packages():
    found = []
    for pkg in ("specdec", "deploy", "edge_agent"):
        for p in (ROOT / pkg).rglob("*.py"):
            if p == ROOT / "specdec" / "clock.py":
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if DIRECT.search(code) and not code.strip().startswith(('"', "'", "``")) and "``time." not in code:
                    found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == [], "\n".join(found)
