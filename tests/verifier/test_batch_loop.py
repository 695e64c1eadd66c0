"""The replica's batch loop (deploy/verifier/batch_loop.py, in-process VerifierServer, no Serve): when
a forward runs and what goes into it."""

from __future__ import annotations

import asyncio

from deploy.config import AppConfig


def test_the_batch_wait_is_skipped_when_no_other_session_could_join():
    """The fixed batch wait lets more rounds join a forward: with every session already queued
    (one session alone, above all) or the batch full, nobody could, and the wait is only latency."""
    from deploy.verifier.server import VerifierServer
    from deploy.verifier.scheduler import Pending

    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"max_batch_sessions": 3}))
    may_join = []
    for sessions, queued in ((1, 0), (1, 1), (2, 1), (2, 2), (4, 3), (5, 3)):
        core.engine.sessions = {f"s{i}": None for i in range(sessions)}
        core.loop.sched = type(core.loop.sched)()
        for i in range(queued):
            core.loop.sched.add(Pending("dev", f"s{i}", 1))
        may_join.append(core.loop.others_may_join())
    assert may_join == [True, False, True, False, False, False]


def test_a_prompt_with_nobody_left_decoding_is_prefilled_in_one_forward():
    """One user between generations: the last session finished (and closed itself), so no verify
    round can come back, and the next prompt goes in as one prefill forward, not in paced chunks
    that each cost a whole forward (they did: 4 + 4 tokens, then the rest). While a session is still
    decoding, the prompt is still paced."""
    from specdec.protocol import VerifyFrame
    from tests.verifier.test_replica_run_ahead import decode_rest, make_core, open_session, prompt

    core = make_core(run_ahead_tokens=0, max_batch_tokens=2048)
    sampling = {"max_tokens": 6, "ignore_eos": True}
    long = prompt(31, 300)

    def prefills_of(n_before: int) -> list[int]:
        return [f.tokens for f in core.counters.forwards[n_before:] if f.kind == "prefill" or f.prefill_tokens]

    async def after_a_finished_generation():
        first = await open_session(core, prompt(30), sampling, close_on_finish=True)
        await decode_rest(core, first, ahead=False, close=False)  # its last reply closes it
        n, fed = len(core.counters.forwards), core.stats()["prefill_tokens_total"]
        await open_session(core, long, sampling, close_on_finish=True)  # at once, as the next user's
        assert core.stats()["prefill_tokens_total"] - fed == 300  # what the benchmarks count per generation
        return prefills_of(n)

    async def beside_a_decoding_session():
        other = await open_session(core, prompt(32), {"max_tokens": 200, "ignore_eos": True})
        sid, at = other["session_id"], other["prefix_len"]
        status, _ = await core.verify(sid, "dev", VerifyFrame(at, [], []).encode())  # it verified just now
        assert status == 200
        n, fed = len(core.counters.forwards), core.stats()["prefill_tokens_total"]
        await open_session(core, prompt(33, 300), sampling)  # not `long`: that one's pages are cached now
        assert core.stats()["prefill_tokens_total"] - fed == 300  # paced chunks add up to the prompt
        return prefills_of(n)

    assert asyncio.run(after_a_finished_generation()) == [300]
    paced = asyncio.run(beside_a_decoding_session())
    assert len(paced) > 1 and sum(paced) == 300, paced  # chunks in the gaps of the other session's rounds