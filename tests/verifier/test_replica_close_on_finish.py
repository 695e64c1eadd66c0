"""``close_on_finish`` on a replica (the VerifierServer batch loop, no Serve): a session opened with
it is closed with the reply that finishes it, whichever reply that is (a round's, a run-ahead's,
the open's own), and only after that reply carries every token; a later request meets a clear
410, a close answers 200; a session opened without it is held until it is closed."""

from __future__ import annotations

import asyncio

import pytest

from specdec.protocol import VerifyFrame
from tests.verifier.test_replica_run_ahead import decode_rest, greedy_reference, make_core, open_session, prompt


async def gone(core, sid: str) -> None:
    """The session is released everywhere in the replica; its requests answer 410, a close 200."""
    await asyncio.sleep(0.05)  # the engine's close runs on the worker thread, after the reply
    assert sid not in core.engine.sessions and sid not in core.owner and sid not in core.sessions.client
    status, err = await core.verify(sid, "dev", VerifyFrame(0, [], []).encode())
    assert status == 410 and "finished and was closed" in err["error"]["message"], err
    assert core.stats()["evictions"] == 0  # closed as it finished: not an eviction
    assert await core.close_session(sid, "dev") == (200, {"closed": sid})


@pytest.mark.parametrize("run_ahead", [0, 4], ids=["rounds", "run-ahead"])
def test_a_session_opened_with_close_on_finish_goes_with_its_finishing_reply(run_ahead):
    core = make_core(run_ahead_tokens=run_ahead)
    p = prompt(21)
    sampling = {"max_tokens": 20, "ignore_eos": True}
    ref = greedy_reference(core, p, 20)

    async def run(close_on_finish: bool):
        d = await open_session(core, p, sampling, close_on_finish=close_on_finish)
        assert d["close_on_finish"] is close_on_finish
        out = await decode_rest(core, d, ahead=run_ahead > 0, close=False)
        if close_on_finish:
            await gone(core, d["session_id"])
        else:  # held until closed, as before
            await asyncio.sleep(0.05)
            assert d["session_id"] in core.engine.sessions
            assert await core.close_session(d["session_id"], "dev") == (200, {"closed": d["session_id"]})
        return out

    assert asyncio.run(run(True)) == ref
    assert asyncio.run(run(False)) == ref
    assert core.pending() == 0 and not core.engine.sessions and "dev" not in core.owner.values()


def test_a_detached_run_that_finishes_waits_for_its_request_before_the_session_goes():
    """The open's run-ahead decodes to the end while the edge is away: the tokens wait in the
    session for the edge's request, and only the reply that carries them closes it."""
    core = make_core(run_ahead_tokens=10)
    p = prompt(22)
    sampling = {"max_tokens": 6, "ignore_eos": True}
    ref = greedy_reference(core, p, 6)

    async def run():
        d = await open_session(core, p, sampling, close_on_finish=True, client={"run_ahead": True})
        await asyncio.sleep(0.2)  # the edge is away: the detached run reaches the end
        sid = d["session_id"]
        assert sid in core.engine.sessions and core.engine.sessions[sid].finished
        out = await decode_rest(core, d, close=False)
        await gone(core, sid)
        return out

    assert asyncio.run(run()) == ref


def test_an_open_that_finishes_at_once_closes_its_session():
    core = make_core()
    d = asyncio.run(open_session(core, prompt(23), {"max_tokens": 1, "ignore_eos": True}, close_on_finish=True))
    assert d["finished"] and d["close_on_finish"] and d["first_token"] is not None
    asyncio.run(gone(core, d["session_id"]))
