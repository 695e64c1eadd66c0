"""Does a long prompt stall the sessions verifying beside it? (chunked prefill)

Eight sessions verify 8-node draft trees back to back through an in-process replica
(:class:`deploy.verifier.server.VerifierServer`: the real batch loop, no Serve); after a
warm-up a ``--prompt``-token prompt is opened. Reported: the server's verify latency
(arrival to reply) before and during that prefill, their ratio, the chunks the prompt went
in, and its time to first token. The test (``tests/verifier/test_server.py``) runs it on
a tiny random model; ``python -m benchmarks.prefill_stall`` on the embedded SmolLM2 (bf16,
one thread on ``--core``) gives the real figure, written to
``benchmarks/results/prefill_stall.json``.
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

from deploy.config import AppConfig
from specdec.protocol import ReplyFrame, VerifyFrame
from deploy.verifier.server import VerifierServer

RESULTS = Path(__file__).resolve().parent / "results"
TREE_PARENTS = [-1, 0, 1, 2, -1, 4, 5, 6]  # two chains of four


def run(cfg: AppConfig, prompt_tokens: int = 4096, sessions: int = 8, warmup_s: float = 1.5) -> dict:
    core = VerifierServer(cfg)
    vocab = core.loaded.vocab_size
    rng = random.Random(0)
    sampling = {"max_tokens": 1_000_000, "ignore_eos": True}

    async def main():
        opened = [await core.open_session("dev", {"prompt_ids": [rng.randrange(3, vocab) for _ in range(64)],
                                                  "sampling": sampling}) for _ in range(sessions)]
        assert all(st == 200 for st, _ in opened), opened
        stop = asyncio.Event()

        async def verify_loop(sid: str, prefix_len: int):
            while not stop.is_set():
                tokens = [rng.randrange(3, vocab) for _ in TREE_PARENTS]
                status, reply = await core.verify(sid, "dev", VerifyFrame(prefix_len, tokens, TREE_PARENTS).encode())
                assert status == 200, reply
                prefix_len = ReplyFrame.decode(reply).prefix_len

        loops = [asyncio.create_task(verify_loop(p["session_id"], p["prefix_len"])) for _, p in opened]
        await asyncio.sleep(warmup_s)
        warm = list(core.counters.round_latencies)  # (the bounded record would drop them during the prefill)
        t_open = time.monotonic()
        status, payload = await core.open_session(
            "dev", {"prompt_ids": [rng.randrange(3, vocab) for _ in range(prompt_tokens)], "sampling": sampling})
        t_done = time.monotonic()
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*loops)
        return status, payload, warm, t_open, t_done

    status, payload, warm, t_open, t_done = asyncio.run(main())
    before = [s for t, s in warm if t_open - 0.8 * warmup_s < t < t_open - 0.3 * warmup_s]  # warmed up
    during = [s for t, s in core.counters.round_latencies if t_open <= t and t + s <= t_done]
    rode = [f.prefill_tokens for f in core.counters.forwards if f.kind == "verify" and f.prefill_tokens]
    b, d = (statistics.median(x) if x else None for x in (before, during))
    return {"status": status, "prefix_len": payload.get("prefix_len"), "prompt_tokens": prompt_tokens,
            "sessions": sessions, "verify_ms_before": b and b * 1e3, "verify_ms_during": d and d * 1e3,
            "ratio": d / b if b and d else None, "rounds_before": len(before), "rounds_during": len(during),
            "chunks": len(rode), "chunk_tokens_max": max(rode, default=0),
            "chunk_tokens_median": statistics.median(rode) if rode else 0,
            "max_forward_tokens": max(f.tokens for f in core.counters.forwards), "ttft_s": t_done - t_open}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "prefill_stall.json"))
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {args.core})
    cfg = AppConfig(target={"model": "embedded", "dtype": "bfloat16"},
                    verifier={"batch_wait_ms": 0, "max_prompt_tokens": 8192, "torch_threads": 1})
    res = run(cfg, args.prompt, warmup_s=6.0)
    res["conditions"] = {"model": "SmolLM2-135M-Instruct (embedded)", "dtype": "bfloat16", "threads": 1,
                         "core": args.core, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(res, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
