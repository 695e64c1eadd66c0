"""The replica's batch loop (in-process VerifierCore, no Serve): chunked prefill interleaved
with verify batches, so a long prompt never stalls other sessions' verify rounds."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from deploy.config import AppConfig
from deploy.protocol import ReplyFrame, VerifyFrame
from deploy.verifier.deployment import VerifierCore

LONG = 4096


def _core() -> VerifierCore:
    return VerifierCore(AppConfig(
        target={"model": "tiny-random", "dtype": "bfloat16", "max_model_len": 8192,
                "tiny_config": {"max_position_embeddings": 8192}},
        verifier={"batch_wait_ms": 0, "max_prompt_tokens": 8192, "prefill_chunk_tokens": 256,
                  "max_batch_tokens": 2048}))


def test_a_4096_token_prompt_does_not_stall_eight_verifying_sessions():
    core = _core()
    rng = random.Random(0)
    sampling = {"max_tokens": 100_000, "ignore_eos": True}

    async def main():
        opened = [await core.open_session("dev", {"prompt_ids": [rng.randrange(3, 512) for _ in range(64)],
                                                  "sampling": sampling}) for _ in range(8)]
        assert all(st == 200 for st, _ in opened)
        latencies: list[tuple[float, float]] = []  # (start, seconds)
        stop = asyncio.Event()

        async def verify_loop(sid: str, prefix_len: int):
            while not stop.is_set():
                tokens = [rng.randrange(3, 512) for _ in range(8)]
                frame = VerifyFrame(prefix_len, tokens, [-1, 0, 1, 2, -1, 4, 5, 6]).encode()
                t0 = time.perf_counter()
                status, reply = await core.verify(sid, "dev", frame)
                latencies.append((t0, time.perf_counter() - t0))
                assert status == 200, reply
                prefix_len = ReplyFrame.decode(reply).prefix_len

        loops = [asyncio.create_task(verify_loop(p["session_id"], p["prefix_len"])) for _, p in opened]
        await asyncio.sleep(1.5)
        t_open = time.perf_counter()
        status, payload = await core.open_session("dev", {"prompt_ids": [rng.randrange(3, 512) for _ in range(LONG)],
                                                          "sampling": sampling})
        t_done = time.perf_counter()
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*loops)
        return status, payload, latencies, t_open, t_done

    status, payload, latencies, t_open, t_done = asyncio.run(main())
    assert status == 200 and payload["prefix_len"] == LONG + 1
    before = [s for t, s in latencies if t < t_open - 0.5 and t > t_open - 1.3]  # warmed up, no prefill
    during = [s for t, s in latencies if t_open <= t and t + s <= t_done]
    assert len(before) >= 16 and len(during) >= 16, (len(before), len(during))
    # the prompt went through in chunks: no forward carried more than a chunk of it
    prefill = [f for f in core.forwards if f.kind == "prefill" and f.tokens > 256]
    assert sum(f.tokens for f in core.forwards if f.kind == "prefill") >= LONG
    assert all(f.tokens <= 2048 for f in core.forwards)
    assert len(prefill) <= 1  # at most one full-budget chunk (when no verify was waiting)
    ratio = statistics.median(during) / statistics.median(before)
    assert ratio <= 2.0, (statistics.median(before), statistics.median(during))
