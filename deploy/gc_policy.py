"""Garbage collection in a serving replica: startup objects frozen, young collections rarer.

CPython's cyclic collector stops the whole process while it runs, so in the router every
collection is event-loop lag for every request it holds (a 429 included), and in the verifier
it delays the next forward. Measured in the router during a 1000-edge-user load test
(``python -m loadtests.run --scenario edge --users 1000``, the probe of
:mod:`deploy.router.probe`): about 36 collections per second at Python's default threshold
(700 new container objects), pauses p50 0.7 ms, p99 40 ms, max 201 ms; the long ones are the
full collections walking every object the process holds, most of them Ray's, FastAPI's and the
tokenizer's, created at startup and never garbage.

:func:`settle` is called once at the end of a replica's constructor: it collects once, moves
everything alive into the permanent generation (``gc.freeze()``: never scanned again) and raises
the first generation's threshold so young collections run about as often as a few per second.
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
