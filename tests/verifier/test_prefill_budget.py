"""Prefill budgets (deploy/verifier/prefill_budget.py) on an in-process VerifierServer: chunks sized
from measured costs, larger for a burst of opens, and a forward of detached steps prefills until an
edge is due back."""

from __future__ import annotations

import time

import pytest

from deploy.config import AppConfig


def test_a_burst_of_opens_gets_a_larger_prefill_chunk_than_one_long_prompt():
    from deploy.verifier.server import VerifierServer

    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"prefill_share": 0.2, "prefill_chunk_tokens": 256}))
    core.prefill.verify_s, core.prefill.token_s = 0.020, 0.001  # measured: 20 ms a verify forward, 1 ms a prompt token
    budgets = {}
    for waiting in (1, 10, 100):
        core.opens.prefilling = {f"s{i}": ("dev", None) for i in range(waiting)}
        budgets[waiting] = core.prefill.budget(len(core.opens.prefilling))
    # 0.2 of a verify forward per session waiting, at most prefill_chunk_tokens
    assert budgets == {1: 4, 10: 40, 100: 256}


def test_a_prefill_chunk_is_costed_and_sized_against_the_forward_it_rides_in():
    """A chunk's cost is what its forward took beyond the cost curve's time for that forward's
    verify rows, and its budget is a share of that forward's predicted time. Against one EMA of
    small forwards, a big batch's own time was charged to its chunk and the budget sank to the
    floor while a burst of prompts waited (forwards of 24 sessions took 4 prompt tokens each)."""
    from deploy.verifier.server import VerifierServer
    from specdec.engine import ForwardStats

    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"prefill_share": 0.2, "prefill_chunk_tokens": 256}))
    for rows in (32, 24, 16, 8, 2, 1):  # 10 ms flat to 2 rows, then 1 ms a row
        for _ in range(3):
            core._on_forward(ForwardStats("verify", rows, rows, 0.010 + 0.001 * max(0, rows - 2)))
    core.pacer.cost.refit()
    assert core.prefill.verify_s < 0.020  # the EMA still leans on the small forwards
    core.prefill.token_s = 0.001
    for _ in range(20):  # 24 sessions + 8 prompt tokens at 1 ms each: 40 ms
        core._on_forward(ForwardStats("verify", 24, 32, 0.040, prefill_tokens=8))
    assert core.prefill.token_s == pytest.approx(0.001, rel=0.05)
    core.opens.prefilling = {f"s{i}": ("dev", None) for i in range(4)}
    # 0.2 x 4 waiting x the 24-row forward's 32 ms / 1 ms a token
    assert core.prefill.budget(len(core.opens.prefilling), 24) == pytest.approx(25, abs=1)
    assert core.prefill.budget(len(core.opens.prefilling), 24) > core.prefill.budget(len(core.opens.prefilling))
    # the prompt tokens computed (GET /v1/stats; benchmarks count them per generation): chunks and prefill forwards
    core._on_forward(ForwardStats("prefill", 1, 50, 0.050))
    assert core.stats()["prefill_tokens_total"] == 20 * 8 + 50


def test_a_forward_of_detached_steps_alone_prefills_until_an_edge_is_due_back():
    """Run-ahead steps of edges that are away wait on nobody: their forward carries as many prompt
    tokens as fit before the first edge is due back (all of the batch's budget when none is
    known), never fewer than the paced chunk; a round a client waits on keeps the paced chunk."""
    from deploy.verifier.server import VerifierServer
    from deploy.verifier.queued_round import QueuedRound
    from specdec.engine import VerifyRequest
    from deploy.verifier.run_ahead import RunAhead
    from deploy.verifier.scheduler import Pending
    from specdec.tree import DraftTree

    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"prefill_share": 0.2, "prefill_chunk_tokens": 256,
                                            "max_batch_tokens": 2048}))
    core.prefill.verify_s, core.prefill.token_s = 0.010, 0.001  # 10 ms a forward (no curve yet), 1 ms a token
    core.opens.prefilling = {"p": ("dev", None)}

    def step(sid, attached):
        run = RunAhead(8, 10, fut=object() if attached else None)
        return Pending("dev", sid, 1, QueuedRound(VerifyRequest(sid, DraftTree.empty(), 10), None, [], run))

    paced = core.prefill.budget(len(core.opens.prefilling), 1)
    assert paced == 4  # 0.2 x 1 waiting x 10 ms / 1 ms a token: the 4-token floor
    assert core.prefill.chunk([step("a", False)], len(core.opens.prefilling), core.arrivals) == 2048  # nobody due back that we know of
    core.arrivals.replied("a", 0.0)
    core.arrivals.arrived("a", 0.030)  # "a" is away 30 ms a round trip
    core.arrivals.replied("a", time.monotonic())
    assert 10 <= core.prefill.chunk([step("a", False)], len(core.opens.prefilling), core.arrivals) <= 20  # ~30 ms away - 10 ms forward, 1 ms a token
    assert core.prefill.chunk([step("a", False), step("b", True)], len(core.opens.prefilling), core.arrivals) == paced

def test_a_prefill_forwards_fixed_cost_is_not_charged_to_its_tokens():
    """A prefill forward of a few tokens costs about what any forward costs (the weights read): its
    tokens are charged only what it took beyond a one-row forward, or small chunks would read dear
    per token and make the next chunks smaller still (issue 61's simulation found it on a GPU profile)."""
    from deploy.verifier.server import VerifierServer
    from specdec.engine import ForwardStats

    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"}))
    core.prefill.verify_s = 0.010  # a verify forward: 10 ms, whatever its rows (no curve yet)
    core._on_forward(ForwardStats("prefill", 1, 20, 0.012))  # 20 tokens: 2 ms beyond the forward's own 10
    assert core.prefill.token_s == pytest.approx(0.0001)
    core._on_forward(ForwardStats("prefill", 1, 20, 0.005))  # faster than a forward (noise): a tenth, not zero
    assert core.prefill.token_s == pytest.approx(0.7 * 0.0001 + 0.3 * 0.000025)


def test_under_a_steady_backlog_of_opens_the_budget_comes_from_the_cost_curve():
    """Every forward carries a chunk while opens queue without end, so no chunkless forward is ever
    timed: the budget is sized from the cost curve and the chunks' measured cost, not stuck at its
    16-token start (issue 61's simulation: an H100 replica prefilled 16 tokens a forward for minutes
    while a hundred opens waited)."""
    from deploy.verifier.server import VerifierServer
    from specdec.engine import ForwardStats

    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32"},
                                  verifier={"prefill_share": 0.2, "prefill_chunk_tokens": 2048}))
    for rows in (4, 8, 16, 32, 8, 4):  # 10 ms + 0.1 ms a row; each with a 16-token chunk of 1.6 ms
        core._on_forward(ForwardStats("verify", rows, rows + 16, 0.010 + 0.0001 * rows + 0.0016, prefill_tokens=16))
    assert core.prefill.verify_s == 0.0 and core.pacer.cost.count >= 3
    assert core.prefill.token_s == pytest.approx(0.0001, rel=0.3)
    assert core.prefill.budget(100) > 1000  # 0.2 x 100 waiting x ~10 ms / 0.1 ms a token
