"""The run-ahead accumulator (deploy/verifier/run_ahead.py): when it decodes on, what its reply says."""

from __future__ import annotations

from deploy.verifier.engine import VerifyResult
from deploy.verifier.run_ahead import RunAhead


def result(prefix_len: int, tokens: tuple[int, ...], accepted=(), finished=False, verified=0, reason=None):
    return VerifyResult("s", tuple(accepted), tokens[-1] if tokens else None, tokens, prefix_len, finished, reason,
                        verified)


def test_it_decodes_on_up_to_its_limit_while_the_budget_is_zero():
    run = RunAhead(limit=3, tree_nodes=4)
    assert not run.started and not run.continues(0, False)
    run.add(result(12, (7, 8), accepted=(0,), verified=2))  # the tree's round: node 0 and the bonus 8
    assert run.started and run.continues(0, False)
    assert not run.continues(4, False)  # trees pay again: reply now, with the hint
    assert not run.continues(0, True)  # the client is gone
    for i, tok in enumerate((9, 10, 11)):
        run.add(result(13 + i, (tok,)))
    assert not run.continues(0, False)  # 3 tokens past the bonus: the limit
    frame = run.frame(depth_hint=0, budget_hint=0)
    assert (frame.accepted, frame.bonus, frame.ahead, frame.prefix_len) == ([0], 8, [9, 10, 11], 15)
    assert frame.verified == 2 and frame.emitted == 5  # the cut of the first round, 1 + 1 + 3 tokens


def test_it_stops_when_the_session_finishes_and_reports_the_finish():
    run = RunAhead(limit=8, tree_nodes=0)
    run.add(result(11, (5,)))
    run.add(result(12, (6,), finished=True, reason="length"))
    assert not run.continues(0, False)
    frame = run.frame(0, 0)
    assert frame.finished and frame.finish_reason == "length" and frame.ahead == [6] and frame.verified is None
    done = RunAhead(limit=8, tree_nodes=2)
    done.add(result(12, (5, 6), accepted=(0, 1), finished=True, reason="stop", verified=2))
    assert not done.continues(0, False) and done.frame(0, 0).ahead == []
