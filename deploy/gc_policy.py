"""Garbage collection in a serving replica: startup objects frozen, young collections rarer.

CPython's cyclic collector stops the whole process while it runs: in the router every collection
is event-loop lag for every request it holds, in the verifier it delays the next forward, and the
long pauses are full collections walking objects created at startup (Ray's, FastAPI's, the
tokenizer's) that are never garbage. :func:`settle`, called once at the end of a replica's
constructor, collects once, moves everything alive into the permanent generation (``gc.freeze()``)
and raises the first generation's threshold so young collections run a few times per second.
Objects are still collected; reference counting frees the rest as before. Pure module.
"""

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
