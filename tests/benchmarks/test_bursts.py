"""benchmarks/bursts.py: background CPU read as a steady rate plus periodic bursts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.bursts import BurstSampler, burst_profile


def _samples(seconds: float, steady: float, bursts: list[tuple[float, float, float]], step: float = 0.1):
    """(t, CPU so far) every ``step``: ``steady`` cores, plus ``cores`` from ``start`` for ``length`` s."""
    out, cpu, t = [], 0.0, 0.0
    while t <= seconds + 1e-9:
        out.append((1000.0 + t, cpu))
        rate = steady + sum(c for s, n, c in bursts if s <= t < s + n - 1e-9)
        cpu += rate * step
        t = round(t + step, 9)
    return out


def test_periodic_bursts_are_read_back_with_their_period_length_and_cores():
    bursts = [(s, 0.8, 0.9) for s in (3.0, 13.0, 23.0, 33.0, 43.0)]
    p = burst_profile(_samples(50.0, 0.05, bursts), 1000.0, 1050.0)
    assert p.bursts == 5 and p.every_s == pytest.approx(10.0, abs=0.11)
    assert p.length_s == pytest.approx(0.8, abs=0.11) and p.cores == pytest.approx(0.9, rel=0.15)
    assert p.steady_cores == pytest.approx(0.05, abs=1e-6)
    assert p.mean_cores == pytest.approx(0.9 * 0.8 / 10.0, rel=0.2)
    # the window bounds what is read: only the three bursts inside it
    assert burst_profile(_samples(50.0, 0.05, bursts), 1010.0, 1040.0).bursts == 3


def test_no_period_without_two_bursts_and_no_burst_in_noise_below_the_threshold():
    assert burst_profile(_samples(50.0, 0.05, [(3.0, 0.8, 0.9)]), 1000.0, 1050.0) is None
    wobble = [(s, 0.1, 0.2) for s in range(1, 50, 2)]  # +0.2 cores: under BURST_ABOVE_CORES
    assert burst_profile(_samples(50.0, 0.05, wobble), 1000.0, 1050.0) is None
    assert burst_profile([], 0.0, 1.0) is None


def test_the_sampler_counts_a_watched_process_cpu_from_when_it_is_first_seen():
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<60: pass"])
    try:
        time.sleep(0.5)  # CPU before it is watched: not counted
        s = BurstSampler(period_s=0.05)
        s.watch([spin.pid, os.getpid() + 10**7])  # and a pid that does not exist
        s.sample()
        assert s.samples[-1][1] == 0.0
        t0 = time.time()
        s.start()
        time.sleep(1.0)
        s.stop()
        wall = time.time() - t0
        assert 0.3 * wall <= s.samples[-1][1] <= wall + 0.05  # about a core (on a shared host, less)
        assert [c for _, c in s.samples] == sorted(c for _, c in s.samples)
    finally:
        spin.kill()
        spin.wait()
