"""The edge agent through the real Serve app (HTTP keep-alive and WebSocket), tiny target."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from ray import serve

from deploy.application import build_app
from specdec.errors import Unauthorized
from specdec.protocol import OpenSession, VerifyFrame
from specdec.proposal import Proposal, draw_without_replacement
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.cli import main as cli_main
from edge_agent.draft_backends import ModelDrafter, NgramDrafter
from edge_agent.transport import HttpTransport, Transport
from tests.edge_agent.helpers import noisy_copy
from tests.serve_apps import delete_app

pytestmark = pytest.mark.ray

KEY = "edge-key-12345"
SOLO_KEY = "solo-key-12345"  # a tenant allowed one session at a time
APP = "edgeagent"
GREEDY = {"max_tokens": 32, "ignore_eos": True}


def app_args(topology: str = "split") -> dict:
    # a small KV budget: several concurrent sessions force LRU evictions (410 -> re-open)
    return {"target": {"model": "tiny-random", "dtype": "float32"}, "topology": topology,
            # chain_top_k 2: rejection-rule replies rarely hold all of p (tail candidates, refills)
            "verifier": {"num_replicas": 1, "kv_budget_tokens": 256, "batch_wait_ms": 2, "chain_top_k": 2,
                         # exit heads (issue 19): dormant unless an edge sets F_EARLY
                         "early_exit": {"enabled": True, "heads": "untrained", "layers": [1]}},
            # the tiny model's forward takes ~1 ms: weighed against a request's CPU outside it (3 ms
            # by default) no tree would pay, and these tests exercise the tree path
            "pacing": {"round_overhead_ms": 0},
            "router": {"tenants": [{"name": "edge", "api_key": KEY, "max_sessions": 64},
                                   {"name": "solo", "api_key": SOLO_KEY, "max_sessions": 1}]}}


@pytest.fixture(scope="module")
def server(ray_session):
    serve.run(build_app(app_args()), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_session['http_port']}/{APP}"
    delete_app(APP)


@pytest.fixture(scope="module")
def colocated(ray_session):
    """The same app with the verifier in the router's replica (deploy/router/in_process.py)."""
    name = f"{APP}-colocated"
    serve.run(build_app(app_args("colocated")), name=name, route_prefix=f"/{name}")
    yield f"http://127.0.0.1:{ray_session['http_port']}/{name}"
    delete_app(name)


def prompts(n: int, seed: int = 5, lo: int = 20, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def generate(url, drafter, prompt, ws=False, transport: Transport | None = None, sampling=None, **cfg):
    t = transport or HttpTransport(url, api_key=KEY, ws=ws, timeout_s=60)
    agent = EdgeAgent(t, drafter, config=AgentConfig(**cfg))
    try:
        return await agent.generate(prompt, sampling or GREEDY)
    finally:
        agent.close()
        await t.aclose()


@pytest.mark.parametrize("ws", [False, True], ids=["http", "ws"])
@pytest.mark.parametrize("mode", ["stop-and-wait", "proactive"])
def test_greedy_through_the_server_equals_reference(server, target, draft, ws, mode):
    (prompt,) = prompts(1, seed=11)
    ref = reference_decode(target, prompt, SamplingParams(**GREEDY))
    res = asyncio.run(generate(server, ModelDrafter(draft), prompt, ws=ws, mode=mode))
    assert res.token_ids == ref
    st = res.stats
    assert st.reopens == 0 and st.accepted_tokens > 0 and st.mean_rtt_ms > 0
    assert st.rounds > 0 and st.mean_round_ms > 0


@pytest.mark.parametrize("ws", [False, True], ids=["http", "ws"])
def test_predraft_through_the_server_equals_reference(server, target, draft, ws):
    """Issue 19: early frames stream through the router's WebSocket mid-forward (a Serve streaming
    call), and over POST as a streamed response (the transport's default); the agent pre-drafts
    from them and the output is the target's."""
    (prompt,) = prompts(1, seed=17)
    ref = reference_decode(target, prompt, SamplingParams(**GREEDY))
    res = asyncio.run(generate(server, ModelDrafter(draft), prompt, ws=ws, mode="proactive", predraft=True))
    assert res.token_ids == ref and res.stats.reopens == 0
    st = res.stats
    assert st.early_frames >= st.rounds - 1 > 0 and st.predraft_hits + st.predraft_misses > 0


@pytest.mark.parametrize("ws", [False, True], ids=["http", "ws"])
def test_rejection_rule_through_the_server(server, target, draft, ws):
    """Issue 17: chains with q(x) through the router and the replica: greedy equals the
    reference; sampled, the edge resamples rejections and asks for more candidates."""
    (prompt,) = prompts(1, seed=13)
    ref = reference_decode(target, prompt, SamplingParams(**GREEDY))
    res = asyncio.run(generate(server, ModelDrafter(draft), prompt, ws=ws, mode="proactive", verify="rejection"))
    assert res.token_ids == ref and res.stats.accepted_tokens > 0 and res.stats.reopens == 0
    sampled = {"temperature": 1.5, "seed": 5, "max_tokens": 40, "ignore_eos": True}
    res = asyncio.run(generate(server, ModelDrafter(noisy_copy(target, 0.3)), prompt, ws=ws, sampling=sampled,
                               mode="proactive", verify="rejection"))
    st = res.stats
    assert len(res.token_ids) == 40 and st.rejections > 3 and st.refills > 0 and st.finish_reason == "length"


async def greedy_sampled_trees(url, ws: bool, prompt: list[int], ref: list[int]) -> tuple[list[int], int]:
    """Greedy through the wire's tree rejection path (F_TREEQ), the edge's half played by hand: each
    round 3 root children drawn without replacement from a proposal holding the reference's next
    token (placed among them most rounds), and under it the token after with its own proposal."""
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    t = HttpTransport(url, api_key=KEY, ws=ws, timeout_s=60)
    try:
        sess = await t.open(OpenSession(prompt_ids=prompt, sampling=GREEDY))
        out, n, accepted = [sess.first_token], sess.prefix_len, 0
        while len(out) < len(ref):
            truth = ref[len(out):len(out) + 2]
            ids = rng.sample([x for x in range(3, 512) if x not in truth], 7) + [truth[0]]
            prop = Proposal(tuple(ids), tuple(rng.randrange(1, 65536) for _ in ids))
            kids = draw_without_replacement(prop, 3, g)
            if rng.random() < 0.7 and truth[0] not in kids:
                kids[-1] = truth[0]
            tokens, parents, props = list(kids), [-1] * 3, [(prop.ids, prop.weights)] + [None] * 3
            if truth[0] in kids and len(truth) > 1:
                sub = (truth[1], 7, 8)
                props[kids.index(truth[0]) + 1] = (sub, (9000, 5000, 100))
                tokens.append(truth[1])
                parents.append(kids.index(truth[0]))
                props.append(None)
            r = await t.verify(sess.session_id, VerifyFrame(prefix_len=n, tokens=tokens, parents=parents,
                                                           proposals=props))
            out += [tokens[a] for a in r.accepted] + ([r.bonus] if r.bonus is not None else [])
            accepted += len(r.accepted)
            n = r.prefix_len
            if r.finished:
                break
        await t.close(sess.session_id)
        return out, accepted
    finally:
        await t.aclose()


@pytest.mark.parametrize("ws", [False, True], ids=["http", "ws"])
def test_tree_rejection_rule_through_the_server(server, target, draft, ws):
    """Issue 17: sampled trees with their proposals (F_TREEQ) through the router and the replica:
    greedy equals the reference (by hand: the agent sends greedy requests as match trees); sampled,
    the agent's trees accept draft tokens and the generation completes."""
    (prompt,) = prompts(1, seed=19)
    ref = reference_decode(target, prompt, SamplingParams(**GREEDY))
    out, accepted = asyncio.run(greedy_sampled_trees(server, ws, prompt, ref))
    assert out == ref and accepted > 5
    res = asyncio.run(generate(server, ModelDrafter(draft), prompt, ws=ws, verify="tree-rejection"))
    assert res.token_ids == ref and res.stats.verify_rule == "match"
    sampled = {"temperature": 0.8, "seed": 5, "max_tokens": 32, "ignore_eos": True}
    res = asyncio.run(generate(server, ModelDrafter(draft), prompt, ws=ws, sampling=sampled, verify="tree-rejection"))
    st = res.stats
    assert st.verify_rule == "tree-rejection" and len(res.token_ids) == 32 and st.finish_reason == "length"
    assert st.accepted_tokens > 0 and st.draft_tokens > st.rounds and st.reopens == 0


@pytest.mark.parametrize("topology", ["split", "colocated"])
def test_evictions_under_load_are_reopened_without_loss(server, colocated, target, draft, topology):
    """Both topologies: 8 concurrent agents over HTTP and WebSocket, stop-and-wait and proactive,
    pre-drafting from early frames on some, against a KV budget that forces evictions."""
    url = colocated if topology == "colocated" else server
    ps = prompts(8, lo=50, hi=70)
    refs = [reference_decode(target, p, SamplingParams(**GREEDY)) for p in ps]

    async def main():
        return await asyncio.gather(*[
            generate(url, ModelDrafter(draft) if i % 2 else NgramDrafter(), p, ws=bool(i % 3 == 0),
                     mode="proactive" if i % 2 else "stop-and-wait", predraft=i % 4 == 1)
            for i, p in enumerate(ps)])

    results = asyncio.run(main())
    for res, ref in zip(results, refs):
        assert res.token_ids == ref
    # 8 sessions of 50-100 KV tokens against a budget of 256: the server must have evicted some
    assert sum(r.stats.reopens for r in results) >= 1


class DeletingTransport(HttpTransport):
    """The real HTTP transport; the session is deleted server-side before round 3 (a lost session)."""

    rounds = 0

    async def verify(self, sid, frame):
        self.rounds += 1
        if self.rounds == 3:
            await HttpTransport.close(self, sid)
        return await super().verify(sid, frame)


def test_session_lost_on_the_server_is_reopened(server, target, draft):
    (prompt,) = prompts(1, seed=12)
    ref = reference_decode(target, prompt, SamplingParams(**GREEDY))
    t = DeletingTransport(server, api_key=KEY)
    res = asyncio.run(generate(server, ModelDrafter(draft), prompt, transport=t, mode="proactive"))
    assert res.token_ids == ref and res.stats.reopens == 1


class CountingTransport(HttpTransport):
    """The real HTTP transport, counting the sessions the agent closes and those it only releases."""

    closes = releases = 0

    async def close(self, sid):
        self.closes += 1
        await super().close(sid)

    async def release(self, sid):
        self.releases += 1
        await super().release(sid)


@pytest.mark.parametrize("ws", [False, True], ids=["http", "ws"])
def test_finished_generations_send_no_close_and_give_the_tenants_slot_back(server, target, draft, ws):
    """close_on_finish through the router: the replica closes each session with its finishing
    reply and the router frees the tenant's slot, so a tenant allowed one session generates three
    times in a row (tree rounds, then the rejection rule) with no close request and no 429 wait."""
    (prompt,) = prompts(1, seed=17)
    ref = reference_decode(target, prompt, SamplingParams(**GREEDY))
    t = CountingTransport(server, api_key=SOLO_KEY, ws=ws, timeout_s=60)
    agents = [EdgeAgent(t, ModelDrafter(draft), config=AgentConfig(verify=v, max_overload_waits=1))
              for v in ("match", "rejection")]

    async def main():
        try:
            return [await agents[0].generate(prompt, GREEDY), await agents[0].generate(prompt, GREEDY),
                    await agents[1].generate(prompt, {"temperature": 1.0, "seed": 3, "max_tokens": 24})]
        finally:
            for a in agents:
                a.close()
            await t.aclose()

    results = asyncio.run(main())
    assert [r.token_ids for r in results[:2]] == [ref, ref] and results[2].stats.finish_reason in ("length", "stop")
    assert all(r.stats.overload_waits == 0 and r.stats.reopens == 0 for r in results)
    assert (t.closes, t.releases) == (0, 3)


class RoundsByPath(HttpTransport):
    """The real HTTP transport, counting verify rounds over POST and over the session's socket."""

    posts = sockets = 0

    async def _request(self, method, path, **kw):
        self.posts += path.endswith("/verify")
        return await super()._request(method, path, **kw)

    async def _verify_ws(self, *args, **kw):
        self.sockets += 1
        return await super()._verify_ws(*args, **kw)


def test_a_sessions_first_round_goes_over_post_while_its_socket_opens(server, target, draft):
    """The WebSocket upgrade is a round trip: the first round goes over POST on the warm
    connection beside it, the rest over the socket; the output is the target's, and nothing of the
    session is left open on this side after it (the socket's closing handshake awaited by aclose)."""
    (prompt,) = prompts(1, seed=19)
    ref = reference_decode(target, prompt, SamplingParams(**GREEDY))
    t = RoundsByPath(server, api_key=KEY, timeout_s=60)
    agent = EdgeAgent(t, ModelDrafter(draft))

    async def main():
        try:
            res = await agent.generate(prompt, GREEDY)
            return res, dict(t._ws), dict(t._connecting)
        finally:
            agent.close()
            await t.aclose()

    res, sockets_left, opening_left = asyncio.run(main())
    assert res.token_ids == ref and res.stats.rounds >= 3
    assert 1 <= t.posts <= 2 and t.sockets == res.stats.rounds - t.posts
    assert not sockets_left and not opening_left and not t._closing


def test_wrong_key_is_a_clear_error(server, capsys):
    with pytest.raises(Unauthorized):
        asyncio.run(generate(server, NgramDrafter(), [1, 2, 3],
                             transport=HttpTransport(server, api_key="not-the-key")))
    rc = cli_main(["generate", "--server", server, "--api-key", "not-the-key", "--prompt-ids", "1,2,3",
                   "--draft", "ngram"])
    assert rc == 2 and "rejected the API key" in capsys.readouterr().err
    rc = cli_main(["generate", "--server", server, "--api-key", KEY, "--prompt-ids", "5,6,7", "--draft", "ngram",
                   "--max-tokens", "8", "--json"])
    assert rc == 0
