"""Run-ahead on a replica (the VerifierServer batch loop, no Serve; deploy/verifier/run_ahead.py):
while the tree budget is 0, a request that asks (F_AHEAD) is decoded on in the following forwards
and answered once with several tokens, exactly the target's (greedy and seeded sampling); a
client that goes, an eviction or a close in the middle stops it without losing a token or
touching another session."""

from __future__ import annotations

import asyncio
import random

import pytest

from deploy.config import AppConfig
from specdec.protocol import ReplyFrame, VerifyFrame
from deploy.verifier.server import VerifierServer
from specdec.model.loading import load_target
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.replica_transport import ReplicaTransport
from tests.edge_agent.helpers import noisy_copy

VOCAB = 512


def make_core(budgets=(0,), **verifier) -> VerifierServer:
    """A replica whose tree budget is 0 from the first round (``budgets=(0,)``: no tree pays)."""
    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"batch_wait_ms": 2, **verifier}, pacing={"tree_budgets": list(budgets)}))
    for rows in (1, 4, 16):  # past the pacer's warm-up (3 forwards), flat: trees would pay if offered
        core.pacer.observe_forward(rows, 0.01)
    return core


def greedy_reference(core, p: list[int], max_tokens: int) -> list[int]:
    return reference_decode(load_target(core.cfg.target).model, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def prompt(seed: int, n: int = 10) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


async def open_session(core, p, sampling, history=(), **body):
    status, d = await core.open_session("dev", {"prompt_ids": p, "sampling": sampling,
                                                "generated_ids": list(history), **body})
    assert status == 200, d
    return d


async def decode(core, p, sampling, ahead=True) -> tuple[list[int], list[ReplyFrame]]:
    """Empty trees until finished; every reply's tokens in order (first token, bonus, run-ahead)."""
    d = await open_session(core, p, sampling)
    sid, n, out, done, replies = d["session_id"], d["prefix_len"], [d["first_token"]], d["finished"], []
    while not done:
        status, raw = await asyncio.wait_for(core.verify(sid, "dev", VerifyFrame(n, [], [], ahead=ahead).encode()), 30)
        assert status == 200, raw
        r = ReplyFrame.decode(raw)
        assert r.prefix_len == n + r.emitted and r.bonus is not None
        out += [r.bonus] + r.ahead
        n, done = r.prefix_len, r.finished
        replies.append(r)
    await core.close_session(sid, "dev")
    return out, replies


def test_run_ahead_is_the_targets_greedy_decoding_in_fewer_requests():
    core = make_core(run_ahead_tokens=5)
    prompts = [prompt(s) for s in range(4)]
    sampling = {"max_tokens": 24, "ignore_eos": True}
    refs = [greedy_reference(core, p, 24) for p in prompts]

    async def main():
        return await asyncio.gather(*(decode(core, p, sampling) for p in prompts),
                                    decode(core, prompts[0], sampling, ahead=False))

    *ran, plain = asyncio.run(main())
    for (out, replies), ref in zip(ran, refs):
        assert out == ref
        assert max(len(r.ahead) for r in replies) == 5  # the limit, reached
        assert len(replies) < len(ref) - 1  # fewer requests than tokens
        assert replies[-1].finished and replies[-1].finish_reason == "length"
    out, replies = plain
    assert out == refs[0] and len(replies) == len(refs[0]) - 1 and not any(r.ahead for r in replies)
    assert core.stats()["tokens_emitted"] == sum(len(r) for r in refs) + len(refs[0])
    assert core.pending() == 0


def test_seeded_sampling_through_run_ahead_is_the_targets_sample_path():
    """Each continuation step samples the bonus from p with the session's own generator, in the
    order round-by-round decoding would: the same seed gives the same tokens, with or without."""
    core = make_core(run_ahead_tokens=7)
    p = prompt(7)
    sampling = {"max_tokens": 30, "temperature": 0.9, "top_p": 0.95, "seed": 11, "ignore_eos": True}
    ref = reference_decode(load_target(core.cfg.target).model, p, SamplingParams.from_dict(sampling))

    async def main():
        return await decode(core, p, sampling), await decode(core, p, sampling, ahead=False)

    (ahead, replies), (plain, _) = asyncio.run(main())
    assert ahead == plain == ref
    assert any(r.ahead for r in replies)


def test_no_run_ahead_while_trees_pay_or_when_off():
    pays = make_core(budgets=(0, 8))
    pays.pacer.best_budget = lambda sessions, ahead=1, away_s=0.0: 8  # trees pay (the real forwards would move a measured curve)
    for core in (pays, make_core(run_ahead_tokens=0)):
        out, replies = asyncio.run(decode(core, prompt(3), {"max_tokens": 12, "ignore_eos": True}))
        assert len(out) == 12 and not any(r.ahead for r in replies)


async def run_started(core, p: list[int], sampling: dict) -> tuple[dict, asyncio.Task]:
    """A new session and its first F_AHEAD request in flight, returned once its first forward has run."""
    d = await open_session(core, p, sampling)
    sid, n = d["session_id"], d["prefix_len"]
    before = core.counters.tokens_emitted
    task = asyncio.create_task(core.verify(sid, "dev", VerifyFrame(n, [], [], ahead=True).encode()))
    while core.counters.tokens_emitted == before:
        await asyncio.sleep(0.0005)
    return d, task


async def decode_rest(core, d, ahead: bool = True, close: bool = True) -> list[int]:
    """The rest of a (re-)opened session, run-ahead on unless ``ahead`` is off (a re-open from
    history has no first token); then the session is closed unless ``close`` is off."""
    out, n, done = [t for t in [d["first_token"]] if t is not None], d["prefix_len"], d["finished"]
    while not done:
        status, raw = await asyncio.wait_for(
            core.verify(d["session_id"], "dev", VerifyFrame(n, [], [], ahead=ahead).encode()), 30)
        assert status == 200, raw
        r = ReplyFrame.decode(raw)
        out += [r.bonus] + r.ahead
        n, done = r.prefix_len, r.finished
    if close:
        await core.close_session(d["session_id"], "dev")
    return out


def test_a_client_gone_mid_run_stops_it_and_the_others_are_untouched():
    core = make_core(run_ahead_tokens=1000)
    p, q = prompt(1), prompt(2)
    sampling = {"max_tokens": 400, "ignore_eos": True}
    ref_q = greedy_reference(core, q, 40)

    async def run():
        d, task = await run_started(core, p, sampling)
        sid, n = d["session_id"], d["prefix_len"]
        task.cancel()  # the client dropped its connection
        other = asyncio.create_task(decode(core, q, {"max_tokens": 40, "ignore_eos": True}))
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        grown = len(core.engine.sessions[sid].prefix)
        await asyncio.sleep(0.2)
        assert len(core.engine.sessions[sid].prefix) == grown < len(p) + 400  # it stopped, far before the end
        out, _ = await other
        # the edge never got that reply: its next request assumes the old prefix and is told the server's
        status, err = await core.verify(sid, "dev", VerifyFrame(n, [], [], ahead=True).encode())
        assert status == 409 and err["error"]["code"] == "prefix_mismatch", err
        await core.close_session(sid, "dev")
        return out

    assert asyncio.run(run()) == ref_q
    assert core.pending() == 0 and not core.engine.sessions


@pytest.mark.parametrize("how", ["evicted", "closed"])
def test_an_eviction_or_close_mid_run_replies_the_tokens_so_far(how):
    """The reply brings every token decoded before the session went; the next request meets the
    eviction (410) and the edge re-opens from its history, so the output is still the target's."""
    core = make_core(run_ahead_tokens=1000)
    p = prompt(5)
    sampling = {"max_tokens": 300, "ignore_eos": True}
    ref = greedy_reference(core, p, 300)

    async def run():
        d, task = await run_started(core, p, sampling)
        sid, n = d["session_id"], d["prefix_len"]
        if how == "evicted":
            await core._evict(sid, "kv_budget")
        else:
            assert (await core.close_session(sid, "dev"))[0] == 200
        status, raw = await asyncio.wait_for(task, 30)
        assert status == 200, raw
        r = ReplyFrame.decode(raw)
        got = [d["first_token"], r.bonus] + r.ahead
        assert r.prefix_len == n + r.emitted and not r.finished and len(got) < 300
        assert got == ref[: len(got)]
        status, err = await core.verify(sid, "dev", VerifyFrame(r.prefix_len, [], [], ahead=True).encode())
        assert status == (410 if how == "evicted" else 404), err
        d2 = await open_session(core, p, sampling, history=got)  # the edge re-opens from its history
        return got + await decode_rest(core, d2)

    assert asyncio.run(run()) == ref
    assert core.pending() == 0 and not core.engine.sessions


def test_edge_agents_take_run_ahead_tokens_and_stay_exact():
    """The edge path end to end (EdgeAgent over the replica's own calls): with the budget at 0
    the agents send empty trees with F_AHEAD, emit the tokens past the bonus, and the output is
    the target's; without run-ahead it is one round per token."""
    core = make_core(run_ahead_tokens=6)
    target = load_target(core.cfg.target).model
    drafter_model = noisy_copy(target, 0.005)
    prompts = [prompt(s) for s in range(3)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    refs = [reference_decode(target, p, params) for p in prompts]

    async def generate(p, run_ahead):
        agent = EdgeAgent(ReplicaTransport(core), ModelDrafter(drafter_model), config=AgentConfig(run_ahead=run_ahead))
        try:
            return await agent.generate(p, params)
        finally:
            agent.close()

    async def main():
        return await asyncio.gather(*(generate(p, True) for p in prompts), generate(prompts[0], False))

    *ran, plain = asyncio.run(main())
    for res, ref in zip(ran, refs):
        st = res.stats
        assert res.token_ids == ref and st.ahead_tokens > 0 and st.draft_forwards == 0
        assert st.tokens == 1 + st.rounds + st.accepted_tokens + st.ahead_tokens
    assert plain.token_ids == refs[0] and plain.stats.ahead_tokens == 0 and plain.stats.rounds == len(refs[0]) - 1


def test_between_reply_and_request_the_session_decodes_on_and_the_request_takes_over():
    """Detached run-ahead: after a reply with hint 0 the session stays in the forwards; the next
    F_AHEAD request at the edge's prefix gets those tokens first (a tree it carries is not
    verified: 0 nodes); any other request at that moment is a clear 409, and nothing changes."""
    core = make_core(run_ahead_tokens=4)
    p = prompt(9)
    ref = greedy_reference(core, p, 40)

    async def run():
        d = await open_session(core, p, {"max_tokens": 40, "ignore_eos": True})
        sid, n = d["session_id"], d["prefix_len"]
        status, raw = await core.verify(sid, "dev", VerifyFrame(n, [], [], ahead=True).encode())
        r = ReplyFrame.decode(raw)
        out, n = [d["first_token"], r.bonus] + r.ahead, r.prefix_len
        await asyncio.sleep(0.2)  # the edge is away: the detached run fills up to the limit
        assert len(core.engine.sessions[sid].prefix) == n + 5
        for bad in (VerifyFrame(n, [], []), VerifyFrame(n - 1, [], [], ahead=True)):
            status, err = await core.verify(sid, "dev", bad.encode())
            assert status == 409 and err["error"]["code"] == "prefix_mismatch" and "ran ahead" in err["error"]["message"]
        status, raw = await core.verify(sid, "dev", VerifyFrame(n, [1, 2, 3], [-1, 0, 1], ahead=True).encode())
        r = ReplyFrame.decode(raw)
        assert status == 200 and r.accepted == [] and r.verified == 0 and len(r.ahead) == 4
        assert core.stats()["run_ahead_takeovers"] == {"running": 0, "full": 1, "stopped": 0}  # the 409s took nothing
        out += [r.bonus] + r.ahead
        return out + (await decode_rest(core, {"session_id": sid, "first_token": None, "prefix_len": r.prefix_len,
                                               "finished": r.finished}))

    assert asyncio.run(run()) == ref


def test_a_run_queued_by_a_request_that_took_over_a_full_run_starts_at_once():
    """An edge slower than its run (the run is full when its request arrives) is answered by the
    request's handler, which queues the next detached run while the batch loop sleeps with nothing
    to do: the loop is woken, so that run decodes now, not after the loop's 5 s idle timeout
    (measured before: 4.9 s rounds at RTT 100 ms)."""
    core = make_core(run_ahead_tokens=4)
    p = prompt(13)

    async def run():
        d = await open_session(core, p, {"max_tokens": 60, "ignore_eos": True})
        sid, n = d["session_id"], d["prefix_len"]
        grown = []
        for _ in range(3):
            status, raw = await core.verify(sid, "dev", VerifyFrame(n, [], [], ahead=True).encode())
            assert status == 200, raw
            n = ReplyFrame.decode(raw).prefix_len
            await asyncio.sleep(0.3)  # the edge is away longer than its run takes
            grown.append(len(core.engine.sessions[sid].prefix) - n)
        # an edge back at once meets its run still decoding
        status, raw = await core.verify(sid, "dev", VerifyFrame(n, [], [], ahead=True).encode())
        status, raw = await core.verify(sid, "dev", VerifyFrame(ReplyFrame.decode(raw).prefix_len, [], [],
                                                                ahead=True).encode())
        assert status == 200, raw
        await core.close_session(sid, "dev")
        return grown, core.stats()["run_ahead_takeovers"]

    grown, takeovers = asyncio.run(run())
    assert grown == [5, 5, 5]  # each detached run full: the bonus and 4 past it
    # the first request opened no run; the next three each met a full one; the fifth, sent at once, a running one
    assert takeovers == {"running": 1, "full": 3, "stopped": 0}


def test_an_open_that_promises_run_ahead_decodes_on_from_its_first_token():
    """``client.run_ahead`` on the open: with hint 0 the session decodes on from its first token
    while the open's reply and the first request are on the wire; that F_AHEAD request takes the
    run over, and the output is the target's. An open without the promise, or whose hint asks
    for trees, waits for its first request as before."""
    core = make_core(run_ahead_tokens=4)
    p = prompt(12)
    sampling = {"max_tokens": 30, "ignore_eos": True}
    ref = greedy_reference(core, p, 30)

    async def run(client):
        status, d = await core.open_session("dev", {"prompt_ids": p, "sampling": sampling, "client": client})
        assert status == 200 and d["budget_hint"] == 0, d
        await asyncio.sleep(0.2)  # the edge is away
        grown = len(core.engine.sessions[d["session_id"]].prefix) - d["prefix_len"]
        return grown, await decode_rest(core, d)

    assert asyncio.run(run({"run_ahead": True})) == (5, ref)  # the bonus and the limit past it
    assert asyncio.run(run({})) == (0, ref)
    pays = make_core(budgets=(0, 8), run_ahead_tokens=4)
    pays.pacer.best_budget = lambda sessions, ahead=1, away_s=0.0: 8  # trees pay: the hint is a tree

    async def open_paid():
        status, d = await pays.open_session("dev", {"prompt_ids": p, "sampling": sampling,
                                                    "client": {"run_ahead": True}})
        await asyncio.sleep(0.2)
        return d["budget_hint"], len(pays.engine.sessions[d["session_id"]].prefix) - d["prefix_len"]

    assert asyncio.run(open_paid()) == (8, 0)


def test_only_forwards_of_trees_alone_measure_how_many_sessions_trees_share():
    """The pacer weighs a tree by the sessions a forward of trees carries (measured, issue 15):
    a forward with a run-ahead step in it says nothing about that, one of trees alone does."""
    core = make_core(budgets=(0, 8))

    async def trees(p, rounds, ahead=False):
        d = await open_session(core, p, {"max_tokens": 40, "ignore_eos": True})
        sid, n = d["session_id"], d["prefix_len"]
        for _ in range(rounds):
            frame = VerifyFrame(n, [5], [-1])
            frame.ahead = ahead  # the agent's default: run-ahead replies when trees stop paying
            status, raw = await core.verify(sid, "dev", frame.encode())
            assert status == 200, raw
            n = ReplyFrame.decode(raw).prefix_len
        return sid

    async def mixed():
        a = asyncio.create_task(decode(core, prompt(1), {"max_tokens": 30, "ignore_eos": True}))
        sid = await trees(prompt(2), 3)
        await a
        await core.close_session(sid, "dev")

    core.pacer.best_budget = lambda sessions, ahead=1, away_s=0.0: 0  # session 1 runs ahead throughout
    asyncio.run(mixed())
    assert core.pacer.state()["tree_sessions_per_forward"] == {}
    del core.pacer.best_budget

    async def both(ahead):
        for sid in await asyncio.gather(trees(prompt(3), 6, ahead), trees(prompt(4), 6, ahead)):
            await core.close_session(sid, "dev")

    core.pacer.best_budget = lambda sessions, ahead=1, away_s=0.0: 8  # trees pay: no run-ahead step
    asyncio.run(both(ahead=True))  # trees of edges that would take run-ahead replies count too
    assert 1.0 <= core.pacer.state()["tree_sessions_per_forward"][2] <= 2.0
    core.pacer._tree_batch.clear()
    del core.pacer.best_budget
    asyncio.run(both(ahead=False))
    assert 1.0 <= core.pacer.state()["tree_sessions_per_forward"][2] <= 2.0
