"""The run-ahead accumulator (deploy/verifier/run_ahead.py): when it decodes on, what its reply says."""

from __future__ import annotations

import asyncio

import pytest

from specdec.engine import VerifyResult
from deploy.verifier.run_ahead import RunAhead


def result(prefix_len: int, tokens: tuple[int, ...], accepted=(), finished=False, verified=0, reason=None):
    return VerifyResult("s", tuple(accepted), tokens[-1] if tokens else None, tokens, prefix_len, finished, reason,
                        verified)


class Fut:
    def __init__(self, done=False):
        self._done = done

    def done(self):
        return self._done


def test_it_decodes_on_up_to_its_limit_while_the_budget_is_zero():
    run = RunAhead(limit=3, base_prefix=10, fut=Fut(), tree_nodes=4)
    assert run.next_prefix == 10
    run.add(result(12, (7, 8), accepted=(0,), verified=2))  # the tree's round: node 0 and the bonus 8
    assert run.continues(0) and run.next_prefix == 12
    assert not run.continues(4)  # trees pay again: reply now, with the hint
    run.fut = Fut(done=True)
    assert not run.continues(0)  # the client is gone
    run.fut = Fut()
    for i, tok in enumerate((9, 10, 11)):
        run.add(result(13 + i, (tok,)))
    assert run.full and not run.continues(0)  # 3 tokens past the bonus: the limit
    frame = run.frame(depth_hint=0, budget_hint=0)
    assert (frame.accepted, frame.bonus, frame.ahead, frame.prefix_len) == ([0], 8, [9, 10, 11], 15)
    assert frame.verified == 2 and frame.emitted == 5  # the cut of the first round, 1 + 1 + 3 tokens


def test_a_detached_run_is_taken_over_by_the_next_request_and_its_tree_is_not_verified():
    run = RunAhead(limit=4, base_prefix=20)  # detached: decoding between a reply and the next request
    assert run.fut is None and run.continues(0)
    run.add(result(21, (5,)))
    run.add(result(22, (6,)))
    run.attach(Fut(), tree_nodes=3)  # the request came with a 3-node tree: the run's tokens answer it
    run.add(result(23, (7,)))
    frame = run.frame(0, 0)
    assert (frame.accepted, frame.bonus, frame.ahead, frame.prefix_len) == ([], 5, [6, 7], 23)
    assert frame.verified == 0  # none of the tree's nodes was verified
    empty = RunAhead(limit=4, base_prefix=20)
    empty.add(result(21, (5,)))
    empty.attach(Fut(), tree_nodes=0)
    assert empty.frame(0, 0).verified is None  # an empty tree: nothing to report


def test_it_stops_when_the_session_finishes_and_reports_the_finish():
    run = RunAhead(limit=8, base_prefix=10, fut=Fut())
    run.add(result(11, (5,)))
    run.add(result(12, (6,), finished=True, reason="length"))
    assert run.ended and not run.continues(0)
    frame = run.frame(0, 0)
    assert frame.finished and frame.finish_reason == "length" and frame.ahead == [6] and frame.verified is None
    done = RunAhead(limit=8, base_prefix=10, fut=Fut(), tree_nodes=2)
    done.add(VerifyResult("s", (0, 1), None, (5, 6), 12, True, "stop", 2))  # finished on an accepted node
    assert done.ended and not done.continues(0)
    frame = done.frame(0, 0)
    assert frame.bonus is None and frame.ahead == [] and frame.accepted == [0, 1]


def test_a_cancelled_future_counts_as_gone():
    async def main():
        fut = asyncio.get_running_loop().create_future()
        run = RunAhead(limit=8, base_prefix=1, fut=fut)
        run.add(result(2, (3,)))
        assert run.continues(0)
        fut.cancel()
        assert not run.continues(0)

    asyncio.run(main())


# -- AheadRuns: the steps it hands back to queue ------------------------------------------------

from deploy.verifier.counters import Takeovers  # noqa: E402
from deploy.verifier.run_ahead import AheadRuns  # noqa: E402
from deploy.verifier.sessions import EdgeClient  # noqa: E402
from specdec.engine import OpenResult  # noqa: E402
from specdec.errors import PrefixMismatch  # noqa: E402


class Frame:
    """The fields of a verify frame a take-over reads."""

    def __init__(self, prefix_len, ahead=True, tokens=()):
        self.prefix_len, self.ahead, self.tokens = prefix_len, ahead, list(tokens)


def test_an_open_that_promised_run_ahead_starts_a_detached_run_with_a_step_to_queue():
    runs = AheadRuns(limit=4, takeovers=Takeovers())
    edge = EdgeClient(ahead=5, run_from_open=True)
    step = runs.from_open("t", OpenResult("s", 7, 10, False, None), edge, budget=0, now=1.0)
    assert step.session_id == "s" and step.payload.req.prefix_len == 10 and len(step.payload.req.tree) == 0
    assert runs.detached["s"] is step.payload.run and step.payload.run.queued
    assert runs.from_open("t", OpenResult("u", 7, 10, False, None), edge, budget=4, now=1.0) is None  # trees pay
    assert "u" not in runs.detached


def test_advance_hands_back_the_next_step_while_the_budget_is_zero():
    runs = AheadRuns(limit=2, takeovers=Takeovers())
    step = runs.step("t", "s", RunAhead(limit=2, base_prefix=10, fut=Fut(), tree_nodes=3), now=0.0)
    nxt = runs.advance(step, result(12, (7, 8), accepted=(0,), verified=3), best_budget=0, now=1.0)
    assert nxt is not None and nxt.payload.req.prefix_len == 12  # decodes on
    assert runs.advance(nxt, result(13, (9,)), best_budget=4, now=2.0) is None  # trees pay: reply now
    assert not nxt.payload.run.queued


def test_a_take_over_at_another_prefix_is_refused_and_the_run_kept():
    runs = AheadRuns(limit=4, takeovers=Takeovers())
    runs.detached["s"] = run = RunAhead(limit=4, base_prefix=20)
    with pytest.raises(PrefixMismatch) as refused:
        runs.take_over("s", Frame(prefix_len=19), Fut())
    assert refused.value.details == {"server_prefix_len": 20}
    assert runs.detached["s"] is run
    assert runs.take_over("s", Frame(prefix_len=20, tokens=(1, 2)), Fut()) is run
    assert "s" not in runs.detached and run.tree_nodes == 2 and runs.takeovers.stopped == 1


def test_a_reply_with_a_zero_budget_detaches_the_next_run_and_a_failed_step_owes_what_was_decoded():
    runs = AheadRuns(limit=4, takeovers=Takeovers())
    run = RunAhead(limit=4, base_prefix=10, fut=Fut(), tree_nodes=0)
    run.add(result(11, (5,)))
    step = runs.replied("t", "s", run, budget=0, now=1.0)
    assert runs.detached["s"] is step.payload.run and step.payload.req.prefix_len == 11
    assert runs.replied("t", "v", run, budget=4, now=1.0) is None  # trees pay: no run
    assert runs.so_far(step) is None  # detached, nothing decoded and no request: nothing owed
    assert "s" not in runs.detached
    owed = runs.step("t", "s", run, now=2.0)
    assert runs.so_far(owed) is run and not run.queued  # its request gets the tokens decoded so far
