"""The run-ahead accumulator (deploy/verifier/run_ahead.py): when it decodes on, what its reply says."""

from __future__ import annotations

import asyncio

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
