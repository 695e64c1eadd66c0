"""Issue 56 in the real Serve app (colocated, tiny random target): a flood of long opens, most shed
by their deadline, leaves the running sessions' verify rounds as fast as without it, and their
output unchanged."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx
import pytest

from tests.router.oracle_edge import oracle_generate
from tests.router.test_app import TINY, VOCAB, deploy
from tests.serve_apps import delete_app

pytestmark = [pytest.mark.ray, pytest.mark.exclusive]

APP = "open-deadline-running"
KEY = "deadline-key-5678"
SESSIONS = 4
FLOOD = 150


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _running(client: httpx.AsyncClient, prompts: list[list[int]]):
    """Each session generates greedily; returns (outputs, seconds between a session's rounds)."""
    gaps: list[float] = []

    async def one(i: int):
        last = [time.perf_counter()]

        async def on_round(sid, n):
            now = time.perf_counter()
            if n > 1:
                gaps.append(now - last[0])
            last[0] = now

        out, _ = await oracle_generate(client, prompts[i], [], {"temperature": 0, "max_tokens": 48}, VOCAB,
                                       seed=i, key=KEY, on_round=on_round)
        return out

    outs = await asyncio.gather(*[one(i) for i in range(len(prompts))])
    return outs, gaps


async def _flood(client: httpx.AsyncClient, rng: random.Random) -> list[int]:
    headers = {"Authorization": f"Bearer {KEY}", "x-open-deadline-s": "0.3"}

    async def open_one():
        body = {"prompt_ids": [rng.randrange(3, VOCAB) for _ in range(500)], "sampling": {"max_tokens": 2},
                "close_on_finish": True}
        r = await client.post("/v1/sessions", json=body, headers=headers)
        return r.status_code

    return await asyncio.gather(*[open_one() for _ in range(FLOOD)])


def test_a_flood_of_opens_leaves_running_sessions_as_fast_and_exact(ray_session):
    url = deploy(APP, {"target": TINY, "topology": "colocated", "verifier": {"batch_wait_ms": 5},
                      "router": {"tenants": [{"name": "r", "api_key": KEY, "max_sessions": 512}]}}, ray_session)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in range(SESSIONS)]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            alone = await _running(c, prompts)
            flood = asyncio.ensure_future(_flood(c, rng))
            await asyncio.sleep(0.05)  # the flood is queued when the sessions start
            crowded = await _running(c, prompts)
            return alone, crowded, await flood

    try:
        (out_alone, gaps_alone), (out_crowded, gaps_crowded), statuses = asyncio.run(main())
    finally:
        delete_app(APP)
    assert out_crowded == out_alone  # the flood changes no running session's output
    assert set(statuses) <= {200, 429} and 429 in statuses, sorted(set(statuses))
    alone, crowded = statistics.median(gaps_alone), statistics.median(gaps_crowded)
    # the admitted opens' prefill rides the verify forwards in paced chunks (verifier.prefill_share):
    # a round may take longer while a prompt is prefilled, never a prompt's whole prefill longer
    print(f"round gap median alone {alone * 1e3:.1f} ms, crowded {crowded * 1e3:.1f} ms; p90 "
          f"{_percentile(gaps_alone, 0.9) * 1e3:.1f} / {_percentile(gaps_crowded, 0.9) * 1e3:.1f} ms; "
          f"opens {statuses.count(200)} admitted, {statuses.count(429)} shed")
    assert crowded <= 2 * alone + 0.02, (alone, crowded)
    assert _percentile(gaps_crowded, 0.9) <= 3 * _percentile(gaps_alone, 0.9) + 0.05, (gaps_alone, gaps_crowded)
