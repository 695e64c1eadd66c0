"""A test-side edge that drafts from a known continuation (an oracle) plus noise.

It speaks the real HTTP protocol and re-opens evicted/lost sessions from its history,
so serving tests can check losslessness (the final tokens equal the reference) under
batching, affinity, eviction and replica restarts independently of the edge agent.
"""

from __future__ import annotations

import asyncio
import random

import httpx

from specdec.protocol import ReplyFrame, VerifyFrame
from edge_agent.transport import is_app_error
from loadtests.faults import oracle_tree


def replica_gone(r: httpx.Response) -> bool:
    """A 5xx that is not the app's JSON error: Serve's proxy answering for a replica that died
    mid-request (the reply is lost; the edge re-opens from its history, as the agent does)."""
    if r.status_code < 500:
        return False
    try:
        body = r.json()
    except ValueError:
        return True
    return not is_app_error(body)


async def oracle_generate(client: httpx.AsyncClient, prompt: list[int], truth: list[int], sampling: dict,
                          vocab: int, seed: int = 0, key: str = "specedge-dev-key", on_round=None,
                          max_reopens: int = 20) -> tuple[list[int], dict]:
    """Generate through the server; returns (generated tokens, counters)."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {key}"}
    out: list[int] = []
    stats = {"rounds": 0, "reopens": 0, "sessions": set(), "sent": 0}  # sent: nodes of the rounds answered

    async def open_session():
        body = {"prompt_ids": prompt, "generated_ids": out, "sampling": sampling}
        for _ in range(50):
            r = await client.post("/v1/sessions", json=body, headers=headers)
            if r.status_code in (429, 503) or replica_gone(r):
                await asyncio.sleep(0.2)
                continue
            r.raise_for_status()
            d = r.json()
            stats["sessions"].add(d["session_id"])
            if d["first_token"] is not None:
                out.append(d["first_token"])
            return d
        raise RuntimeError("could not open a session")

    d = await open_session()
    sid, prefix_len, finished = d["session_id"], d["prefix_len"], d["finished"]
    while not finished:
        tokens, parents = oracle_tree(truth[len(out):], rng, vocab)
        frame = VerifyFrame(prefix_len, tokens, parents, draft_ms=5.0, rtt_ms=1.0, depth=8).encode()
        r = await client.post(f"/v1/sessions/{sid}/verify", content=frame, headers=headers)
        if r.status_code in (404, 410, 503) or replica_gone(r):
            stats["reopens"] += 1
            assert stats["reopens"] <= max_reopens, r.text
            if r.status_code >= 500:
                await asyncio.sleep(0.5)
            d = await open_session()
            sid, prefix_len, finished = d["session_id"], d["prefix_len"], d["finished"]
            continue
        assert r.status_code == 200, r.text
        rep = ReplyFrame.decode(r.content)
        out.extend([tokens[i] for i in rep.accepted] + ([rep.bonus] if rep.bonus is not None else []))
        assert rep.prefix_len == len(prompt) + len(out)
        prefix_len, finished = rep.prefix_len, rep.finished
        stats["rounds"] += 1
        stats["sent"] += len(tokens)
        if on_round is not None:
            await on_round(sid, stats["rounds"])
    await client.delete(f"/v1/sessions/{sid}", headers=headers)
    return out, stats


def replica_killer(deployment: str, after_rounds: int = 3):
    """An ``on_round`` hook for :func:`oracle_generate` that kills, once, the ``deployment`` replica
    holding the session (its tag prefixes the session id) after ``after_rounds`` rounds; Serve
    starts a replacement. Returns (hook, killed): ``killed["name"]`` is the actor it killed."""
    import ray

    killed: dict[str, str] = {}

    async def kill_once(sid: str, rounds: int) -> None:
        if rounds == after_rounds and not killed:
            tag = sid.split(".")[0]
            for a in ray.util.list_named_actors(all_namespaces=True):
                if a["name"].endswith(tag) and f"#{deployment}#" in a["name"]:
                    ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=False)
                    killed["name"] = a["name"]

    return kill_once, killed
