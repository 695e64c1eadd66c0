"""What the exit heads add to a verify forward (issue 19, item 4; the early-exit paper §3).

The embedded target (bf16, one torch thread unless ``--threads``), S fresh sessions with a
100-token prompt each and one 32-node draft tree per session, verified in one forward, with
early results off and on (every session asks; every exit walks every tree), alternating
which goes first. The early results go to the replica's own sink
(:meth:`deploy.verifier.early_stream.EarlyStreams.sink`: each result encoded as an
``EarlyFrame`` and queued for its request's stream), so the cost counts the frames' encoding
and queueing too. Reported per batch size: median verify seconds off / on, the seconds spent
inside the exits (adapter + subset head + the walks + the sink, measured in the hook) as wall
time and as the forward thread's CPU time (``time.thread_time``: what other load on the
machine does not inflate), and their share of the forward. The median over ``--reps``
repetitions damps other load further. ``python -m benchmarks.exit_heads_cost``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from deploy.verifier.early_stream import EarlyStreams
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
from specdec.exit_heads import ALIASES, ExitHeads
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree

OUT = Path(__file__).resolve().parent / "results" / "exit_heads_cost.json"


def tree32(rng: random.Random, vocab: int) -> DraftTree:
    """A 32-node tree: 4 children at the root, then a bushy 3-level shape (like the agent's trees)."""
    parents = [-1, -1, -1, -1] + [i // 3 for i in range(28)]
    return DraftTree(tuple(rng.randrange(vocab) for _ in parents), tuple(parents))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", default="1,4,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", default=None, help="exits to run (default: the artifact's first)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specdec.model.loading import load_model

    lm = load_model("embedded", dtype="bfloat16")
    model = lm.model
    artifact = ALIASES["embedded"]
    if artifact.exists():
        meta = json.loads(artifact.with_suffix(".json").read_text())
        layers = [int(x) for x in args.layers.split(",")] if args.layers else [meta["layers"][0]]
        heads = ExitHeads.load("embedded", model, layers)
    else:  # the cost does not depend on training: the same shapes, untrained
        layers = [int(x) for x in args.layers.split(",")] if args.layers else [12]
        heads = ExitHeads.init(model, layers, rank=64, ids=torch.arange(4096))
    rng = random.Random(0)
    vocab = model.config.vocab_size
    loop = asyncio.new_event_loop()  # the replica's loop: the sink queues frames onto it, drained between reps
    streams = EarlyStreams(heads)
    rows = []
    for S in [int(s) for s in args.sessions.split(",")]:
        eng = VerifierEngine(model, eos_token_ids=())
        times = {False: [], True: []}
        inside, inside_cpu = [], []
        for rep in range(args.reps):
            for early in ((False, True) if rep % 2 == 0 else (True, False)):
                sids = [f"r{rep}{int(early)}s{i}" for i in range(S)]
                eng.exit_heads = heads
                eng.open([OpenRequest(sid, [rng.randrange(3, vocab) for _ in range(100)],
                                      SamplingParams(max_tokens=64)) for sid in sids])
                reqs = [VerifyRequest(sid, tree32(rng, vocab), len(eng.sessions[sid].prefix), early=early)
                        for sid in sids]
                for sid in sids:
                    streams.queues[sid] = asyncio.Queue()
                sink = streams.sink(loop, sids) if early else None
                t0 = time.perf_counter()
                eng.verify(reqs, on_early=sink)
                times[early].append(time.perf_counter() - t0)
                loop.run_until_complete(asyncio.sleep(0))  # run the queued puts (outside the timing)
                if early:
                    assert sum(streams.queues[sid].qsize() for sid in sids) == S * len(layers)
                    inside.append(eng.last_early.seconds)
                    inside_cpu.append(eng.last_early.cpu_seconds)
                for sid in sids:
                    del streams.queues[sid]
                    eng.close(sid)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        row = {"sessions": S, "rows": S * 33, "verify_s_off": off, "verify_s_on": on,
               "exit_s_inside": statistics.median(inside), "exit_cpu_s_inside": statistics.median(inside_cpu),
               "overhead_pct": 100 * (on - off) / off, "exit_share_pct": 100 * statistics.median(inside) / on}
        rows.append(row)
        print(f"S={S:3d}: verify {1e3 * off:.1f} ms off, {1e3 * on:.1f} ms on (+{row['overhead_pct']:.1f} %), "
              f"inside the exits incl. the sink {1e3 * row['exit_s_inside']:.2f} ms wall "
              f"({row['exit_share_pct']:.1f} % of the forward), {1e3 * row['exit_cpu_s_inside']:.2f} ms thread CPU",
              flush=True)
    loop.close()
    doc = {"target": "SmolLM2-135M-Instruct bf16", "threads": args.threads, "exit_layers": list(heads.layers),
           "rank": heads.meta.get("rank"), "vocab_subset": int(heads.ids.numel()), "tree_nodes": 32,
           "prompt_tokens": 100, "reps": args.reps, "sink": "EarlyStreams.sink (encode + queue each frame)",
           "loadavg_end": list(os.getloadavg()),
           "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
