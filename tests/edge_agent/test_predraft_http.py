"""Early frames over HTTP POST (issue 19: "HTTP streaming if it fits"): an ``F_EARLY`` frame sent
with ``Accept: application/x-specedge-frames`` gets a chunked response of records (early frames,
then the reply) through the router's Serve ingress; the agent's HTTP transport (``stream_early``)
pre-drafts from them, and the output is the target's; the records are not buffered to the end of
the forward. Without the ``Accept`` the flag is served
as a plain reply (older POST clients unchanged)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from ray import serve

from deploy.application import build_app
from specdec.errors import PrefixMismatch
from specdec.protocol import EARLY_STREAM_MEDIA_TYPE, EarlyFrame, RecordReader, ReplyFrame, VerifyFrame
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.transport import HttpTransport
from tests.serve_apps import delete_app

pytestmark = pytest.mark.ray

KEY = "edge-key-early-http"
APP = "earlyhttp"
GREEDY = {"max_tokens": 32, "ignore_eos": True}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(ray_session):
    args = {"target": {"model": "tiny-random", "dtype": "float32"},
            "verifier": {"num_replicas": 1, "batch_wait_ms": 2,
                         "early_exit": {"enabled": True, "heads": "untrained", "layers": [1]}},
            # always a tree (no plain-decoding budget 0 on this CPU), so every round asks for early frames
            "pacing": {"tree_budgets": [8, 16, 32], "default_tree_budget": 16},
            "router": {"tenants": [{"name": "edge", "api_key": KEY, "max_sessions": 16}]}}
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_session['http_port']}/{APP}"
    delete_app(APP)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(rng.randint(20, 40))]


def test_a_flagged_post_streams_early_frames_then_the_reply(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as c:
        opened = c.post("/v1/sessions", json={"prompt_ids": prompt(3), "sampling": GREEDY}).json()
        sid, n = opened["session_id"], len(prompt(3)) + 1
        frame = VerifyFrame(prefix_len=n, tokens=[7, 8, 9], parents=[-1, 0, 0], early=True).encode()
        with c.stream("POST", f"/v1/sessions/{sid}/verify", content=frame,
                      headers={"Accept": EARLY_STREAM_MEDIA_TYPE}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(EARLY_STREAM_MEDIA_TYPE)
            reader, msgs = RecordReader(), []
            for chunk in r.iter_raw():
                msgs += reader.feed(chunk)
        assert reader.pending == 0 and len(msgs) == 2
        early, reply = EarlyFrame.decode(msgs[0]), ReplyFrame.decode(msgs[1])
        assert early.layer == 1 and early.prefix_len == n and 0.0 <= early.confidence <= 1.0
        assert set(early.accepted) <= {0, 1, 2} and set(reply.accepted) <= {0, 1, 2}
        # the same flag without the Accept: one plain reply frame, as before the stream existed
        n = reply.prefix_len
        plain = c.post(f"/v1/sessions/{sid}/verify", content=VerifyFrame(prefix_len=n, tokens=[5], parents=[-1],
                                                                        early=True).encode())
        assert plain.headers["content-type"] == "application/octet-stream"
        assert ReplyFrame.decode(plain.content).prefix_len > n
        # an error before any early frame is a plain error response with its status
        bad = c.post(f"/v1/sessions/{sid}/verify", headers={"Accept": EARLY_STREAM_MEDIA_TYPE},
                     content=VerifyFrame(prefix_len=n, tokens=[5], parents=[-1], early=True).encode())
        assert bad.status_code == 409 and json.loads(bad.content)["error"]["code"] == PrefixMismatch.code
        c.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("stream_early", [True, False], ids=["streamed", "plain"])
def test_predraft_over_http_post_equals_reference(server, target, draft, stream_early):
    p = prompt(17)
    ref = reference_decode(target, p, SamplingParams(**GREEDY))

    async def run():
        t = HttpTransport(server, api_key=KEY, ws=False, stream_early=stream_early, timeout_s=60)
        agent = EdgeAgent(t, ModelDrafter(draft), config=AgentConfig(mode="proactive", predraft=True))
        try:
            return await agent.generate(p, GREEDY)
        finally:
            agent.close()
            await t.aclose()

    res = asyncio.run(run())
    assert res.token_ids == ref and res.stats.reopens == 0
    st = res.stats
    if stream_early:
        assert st.early_frames >= st.rounds - 1 > 0 and st.predraft_hits + st.predraft_misses > 0
    else:
        assert st.early_frames == 0


@pytest.fixture(scope="module")
def wide_server(ray_session):
    """A target whose layers after the exit take a while (wide, 8 layers): the gap to see frames stream."""
    args = {"target": {"model": "tiny-random", "dtype": "float32",
                       "tiny_config": {"num_layers": 8, "hidden_size": 512, "intermediate_size": 2048,
                                       "num_heads": 8, "num_kv_heads": 4}},
            "verifier": {"num_replicas": 1, "batch_wait_ms": 0, "torch_threads": 1,
                         "early_exit": {"enabled": True, "heads": "untrained", "layers": [1]}},
            "router": {"tenants": [{"name": "edge", "api_key": KEY, "max_sessions": 16}]}}
    serve.run(build_app(args), name=APP + "wide", route_prefix=f"/{APP}wide")
    yield f"http://127.0.0.1:{ray_session['http_port']}/{APP}wide"
    delete_app(APP + "wide")


def test_the_early_record_reaches_the_client_before_the_forward_ends(wide_server):
    """The stream is not buffered to its end: the early record (after layer 1 of 8) arrives well
    before the reply record (after layer 8; a 64-node tree on a wide target, one thread)."""
    rng = random.Random(1)
    parents = [-1] + [(i - 1) // 2 for i in range(1, 64)]  # a binary tree, depth 6
    with httpx.Client(base_url=wide_server, headers=AUTH, timeout=60) as c:
        p = prompt(5)
        sid = c.post("/v1/sessions", json={"prompt_ids": p, "sampling": GREEDY}).json()["session_id"]
        n, gaps = len(p) + 1, []
        for _ in range(3):
            frame = VerifyFrame(prefix_len=n, tokens=[rng.randrange(3, 512) for _ in parents], parents=parents,
                                early=True)
            arrivals = []
            with c.stream("POST", f"/v1/sessions/{sid}/verify", content=frame.encode(),
                          headers={"Accept": EARLY_STREAM_MEDIA_TYPE}) as r:
                reader = RecordReader()
                for chunk in r.iter_raw():
                    arrivals += [(time.perf_counter(), m) for m in reader.feed(chunk)]
            (t_early, early), (t_reply, reply) = arrivals
            assert EarlyFrame.is_early(early) and not EarlyFrame.is_early(reply)
            n = ReplyFrame.decode(reply).prefix_len
            gaps.append(t_reply - t_early)
        c.delete(f"/v1/sessions/{sid}")
    assert max(gaps) > 0.02, gaps  # seven layers of 65 rows after the exit: tens of ms at least
