"""Issue 56 in the real Serve app (colocated, tiny random target): a burst of long opens past
the verifier's prefill capacity; every open is answered within its deadline, 200 or 429 with
Retry-After, and none waits past it."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.router.test_app import TINY, VOCAB, deploy
from tests.serve_apps import delete_app

pytestmark = [pytest.mark.ray, pytest.mark.exclusive]

APP = "open-deadline"
KEY = "deadline-key-1234"
DEADLINE_S = 0.3


def test_a_burst_of_opens_is_answered_within_the_deadline(ray_session):
    url = deploy(APP, {"target": TINY, "topology": "colocated", "verifier": {"batch_wait_ms": 5},
                      "router": {"tenants": [{"name": "d", "api_key": KEY, "max_sessions": 512}]}}, ray_session)
    rng = random.Random(0)
    headers = {"Authorization": f"Bearer {KEY}", "x-open-deadline-s": str(DEADLINE_S)}

    async def open_one(c: httpx.AsyncClient):
        body = {"prompt_ids": [rng.randrange(3, VOCAB) for _ in range(500)], "sampling": {"max_tokens": 4},
                "close_on_finish": True}
        t0 = time.perf_counter()
        r = await c.post("/v1/sessions", json=body, headers=headers)
        took = time.perf_counter() - t0
        if r.status_code == 200:
            await c.delete(f"/v1/sessions/{r.json()['session_id']}", headers=headers)
        return r.status_code, took, r.headers.get("Retry-After"), r.json().get("error", {}).get("reason")

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            await open_one(c)  # the first open measures the prefill rate
            results = await asyncio.gather(*[open_one(c) for _ in range(200)])
            # the OpenAI routes take the same header: a deadline no prefill meets is a 429
            openai = await c.post("/v1/completions", json={"prompt": [rng.randrange(3, VOCAB) for _ in range(500)],
                                                           "max_tokens": 2},
                                  headers={**headers, "x-open-deadline-s": "0.001"})
            return results, openai

    try:
        results, openai = asyncio.run(main())
    finally:
        delete_app(APP)
    assert openai.status_code == 429 and openai.headers.get("Retry-After"), openai.text
    assert "deadline" in openai.json()["error"]["message"], openai.text
    ok = [t for s, t, _, _ in results if s == 200]
    shed = [(t, ra, why) for s, t, ra, why in results if s == 429]
    assert len(ok) + len(shed) == len(results), {s for s, *_ in results}
    assert ok and shed, (len(ok), len(shed))  # the burst is past capacity, and some opens still got in
    # the proxy's and the client's share of an answer on a shared 2-core machine (200 bodies sent at
    # once) comes on top of the router's deadline: typically ~0.3 s, once 1.0 s in a clean-clone run
    took = sorted(ok + [t for t, _, _ in shed])
    assert took[len(took) // 2] < DEADLINE_S + 0.5 and took[-1] < DEADLINE_S + 1.5, took[-5:]
    assert all(ra for _, ra, _ in shed)
    assert {"open_deadline", "open_deadline_passed"} & {why for _, _, why in shed}  # shed by the deadline itself
