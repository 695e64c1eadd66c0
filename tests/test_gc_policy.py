"""deploy/gc_policy.py, in a child interpreter (it changes the process's collector for good)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc, json, sys
from deploy.gc_policy import settle
held = [[i] for i in range(50_000)]  # what a replica's constructor leaves alive
before = gc.get_freeze_count()
out = {"zero": settle(0), "frozen_zero": gc.get_freeze_count() - before}
out["set"] = settle(int(sys.argv[1]))
out["frozen"] = gc.get_freeze_count() - before
a = []; a.append(a); del a  # a cycle made after settle() is still collected
out["collected"] = gc.collect()
json.dump(out, sys.stdout)
"""


def test_settle_freezes_what_is_alive_and_raises_gen0_only():
    import json

    default = subprocess.run([sys.executable, "-c", "import gc; print(gc.get_threshold())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    g0, g1, g2 = eval(default)  # noqa: S307 (our own child's tuple)
    out = json.loads(subprocess.run([sys.executable, "-c", CHILD, "20000"], capture_output=True, text=True,
                                    check=True).stdout)
    assert tuple(out["zero"]) == (g0, g1, g2) and out["frozen_zero"] == 0  # 0: Python's collector untouched
    assert tuple(out["set"]) == (20000, g1, g2)
    assert out["frozen"] >= 50_000  # the startup objects are never scanned again
    assert out["collected"] >= 1
