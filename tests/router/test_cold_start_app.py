"""Issue 67 in the real Serve app (split topology, one verifier replica, tiny random target): a
cold start, short opens and one-token completions never leave an idle server refusing longer
opens; a prompt near max_model_len is served whatever its own prefill takes; a burst of long
opens is admitted up to what fits, not refused whole; a prompt over max_prompt_tokens is a 400."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.router.test_app import TINY, VOCAB, deploy
from tests.serve_apps import delete_app

pytestmark = [pytest.mark.ray, pytest.mark.exclusive]

APP = "cold-start"
KEY = "cold-start-key-1234"
DEADLINE_S = 0.05  # shorter than the long prompts' own prefill: only waiting counts against it


def test_an_idle_server_never_refuses_an_open_for_its_deadline(ray_session):
    url = deploy(APP, {"target": TINY, "verifier": {"max_prompt_tokens": 8192},
                      "router": {"tenants": [{"name": "c", "api_key": KEY, "max_sessions": 512}]}}, ray_session)
    rng = random.Random(0)
    headers = {"Authorization": f"Bearer {KEY}", "x-open-deadline-s": str(DEADLINE_S)}

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    async def open_one(c: httpx.AsyncClient, n: int):
        body = {"prompt_ids": ids(n), "sampling": {"max_tokens": 1}, "close_on_finish": True}
        t0 = time.perf_counter()
        r = await c.post("/v1/sessions", json=body, headers=headers)
        return r, time.perf_counter() - t0

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            seq = [await open_one(c, n) for n in (2, 32, 500)]  # the first reproduction
            # the router's one-time loads (torch, the tokenizer) at its first OpenAI request count against
            # that request's deadline (issue 56): that one goes with the default deadline
            first = await c.post("/v1/completions", json={"prompt": ids(1), "max_tokens": 1},
                                 headers={"Authorization": f"Bearer {KEY}"})
            assert first.status_code == 200, first.text
            words = [await c.post("/v1/completions", json={"prompt": ids(1), "max_tokens": 1}, headers=headers)
                     for _ in range(25)]
            seq += [await open_one(c, n) for n in (300, 600, 1000)]  # after 25 one-word completions
            info = (await c.get("/v1/models", headers=headers)).json()
            near = await open_one(c, 4096 - 8)  # nearly the tiny target's max_model_len
            over = await open_one(c, 9000)
            burst = await asyncio.gather(*[open_one(c, 1500) for _ in range(60)])
            return seq, words, info, near, over, burst

    try:
        seq, words, info, near, over, burst = asyncio.run(main())
    finally:
        delete_app(APP)
    assert [r.status_code for r, _ in seq] == [200] * 6, [(r.status_code, r.text) for r, _ in seq]
    assert all(r.status_code == 200 for r in words), [r.text for r in words if r.status_code != 200][:3]
    assert near[0].status_code == 200, near[0].text
    print(f"near max_model_len: answered in {near[1]:.3f} s with a {DEADLINE_S} s deadline")
    assert over[0].status_code == 400 and "max_prompt_tokens" in over[0].text, over[0].text
    ok = [t for r, t in burst if r.status_code == 200]
    shed = [r for r, _ in burst if r.status_code == 429]
    assert len(ok) + len(shed) == len(burst), {r.status_code for r, _ in burst}
    assert ok and shed, (len(ok), len(shed))  # the first ones admitted, the rest refused
    assert all(r.headers.get("Retry-After") for r in shed)
    assert {r.json()["error"]["reason"] for r in shed} <= {"open_deadline", "open_deadline_passed"}
    print(f"burst of 60 x 1500 tokens: {len(ok)} admitted, {len(shed)} refused; model {info['data'][0]['id']}")
