"""Garbage collection in a serving replica: startup objects frozen, young collections rarer.

:func:`settle`, once at the end of a replica's constructor. Why: docs/router.md, "Garbage collection". Pure module."""

from __future__ import annotations

import gc


def settle(gen0_threshold: int) -> tuple[int, int, int]:
    """Freeze what the process holds now and set generation 0's threshold (0: leave Python's).
    Returns the thresholds in force."""
    if gen0_threshold > 0:
        gc.collect()
        gc.freeze()
        _, g1, g2 = gc.get_threshold()
        gc.set_threshold(gen0_threshold, g1, g2)
    return gc.get_threshold()
