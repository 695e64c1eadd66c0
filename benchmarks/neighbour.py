"""How much the edge core's drafting slows the server core's forward on this machine.

``benchmarks.run`` puts the Serve app on core 0 and every edge session on core 1, so in the
edge-drafted modes core 1 runs the draft model (proactive drafting keeps it busy), while in
``server_ar`` and the vLLM rows it only runs streaming clients. On a host whose two vCPUs
share a physical core's resources (caches, memory bandwidth, possibly the core itself), the
neighbour's work slows the server: a cost real edges, on their own devices, never put on the
server. This measures it: the verifier's forward (the embedded SmolLM2-135M, bf16, one thread
on ``--core``) at 1, 4 and 16 rows, in alternating bursts with the other core idle and with
the other core running the embedded draft model's forward in a loop (4-row forwards over a
256-token prefix through the same ``ModelRunner`` the edge drafter uses, bf16, one thread: the
edge's workload).

``python -m benchmarks.neighbour [--bursts 6] [--out FILE]`` prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

NEIGHBOUR = """
import os, torch
os.sched_setaffinity(0, {%d}); torch.set_num_threads(1)
from specdec.model.batch import chunk_input
from specdec.model.runner import ModelRunner
from edge_agent.embedded_draft import load_draft
r = ModelRunner(load_draft(None, "embedded-draft", dtype="bfloat16"), kv_capacity_tokens=4096)
ids = list(range(100, 400))
r.forward(0, [chunk_input("s", 0, ids[:256], [255])])
r.commit(0, {"s": (256, [])})
print("ready", flush=True)
b = 1
while True:  # the edge drafter's forwards: a few rows over a 256-token prefix, rolled back
    r.forward(b, [chunk_input("s", 256, ids[256:260], [3])])
    r.abort(b)
    b += 1
"""


class Neighbour:
    """The draft model's forwards in a loop on the other core (a child process, stopped by PID)."""

    def __init__(self, core: int):
        self.p = subprocess.Popen([sys.executable, "-c", NEIGHBOUR % core], stdout=subprocess.PIPE, text=True,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if self.p.stdout.readline().strip() != "ready":
            raise RuntimeError("the neighbour process did not start")
        self.pause()

    def pause(self) -> None:
        os.kill(self.p.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.p.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.p.terminate()
        self.p.wait(timeout=30)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--core", type=int, default=0, help="the server core (the neighbour takes the other)")
    ap.add_argument("--bursts", type=int, default=6, help="bursts per case and state, alternating")
    ap.add_argument("--rounds", type=int, default=8, help="forwards per burst")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    other = next(c for c in sorted(os.sched_getaffinity(0)) if c != args.core)
    os.sched_setaffinity(0, {args.core})

    import torch

    torch.set_num_threads(1)
    from benchmarks.verify_step import Case
    from specdec.model.loading import load_model

    lm = load_model("embedded", dtype="bfloat16", device="cpu")
    rng = random.Random(0)
    cases = {1: Case(lm.model, 256, 1, 0, rng), 4: Case(lm.model, 256, 1, 3, rng), 16: Case(lm.model, 256, 16, 0, rng)}
    for c in cases.values():
        for _ in range(3):
            c.run()
    neighbour = Neighbour(other)
    ms: dict[tuple[int, str], list[float]] = {(r, s): [] for r in cases for s in ("idle", "drafting")}
    try:
        for _ in range(args.bursts):
            for state in ("idle", "drafting"):
                (neighbour.resume if state == "drafting" else neighbour.pause)()
                time.sleep(0.3)
                for rows, c in cases.items():
                    c.forward_s.clear()
                    for _ in range(args.rounds):
                        c.run()
                    ms[(rows, state)] += [s * 1e3 for s in c.forward_s]
    finally:
        neighbour.stop()
    out = {"conditions": {"model": "SmolLM2-135M-Instruct (embedded)", "dtype": "bfloat16", "server_core": args.core,
                          "neighbour_core": other, "neighbour": "embedded draft, 4-row forwards in a loop (ModelRunner), bf16, 1 thread",
                          "bursts": args.bursts, "rounds": args.rounds, "loadavg": os.getloadavg()[0]},
           "rows": [{"rows": r, "idle_ms": statistics.median(ms[(r, "idle")]),
                     "drafting_ms": statistics.median(ms[(r, "drafting")]),
                     "ratio": statistics.median(ms[(r, "drafting")]) / statistics.median(ms[(r, "idle")])}
                    for r in cases]}
    print(f"Forward ms on core {args.core} (median of {args.bursts} x {args.rounds}), core {other} idle vs "
          "running the draft model:\n\n| rows | other core idle | other core drafting | ratio |\n|---|---|---|---|")
    for r in out["rows"]:
        print(f"| {r['rows']} | {r['idle_ms']:.1f} | {r['drafting_ms']:.1f} | x{r['ratio']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
