import math
from collections import Counter

import pytest

from deploy.verifier.pacing import Pacer, _prior


def test_depth_matches_verify_time_minus_rtt():
    p = Pacer(min_depth=1, max_depth=12)
    for x in (33, 66, 132, 264):
        p.observe_forward(x, 0.010 + 0.0005 * x)  # verify(33 tokens) = 26.5 ms
    # two sessions, 32-node trees: 43 ms verify (66 rows); 5 ms RTT; 5 ms per draft forward -> ~8 forwards
    assert p.depth_hint(2, 32, draft_ms=5.0, rtt_ms=5.0) == 8
    # longer RTT -> shallower drafts (SpecEdge Fig. 12 trend)
    assert p.depth_hint(2, 32, draft_ms=5.0, rtt_ms=20.0) < 8
    assert p.depth_hint(2, 32, draft_ms=5.0, rtt_ms=500.0) == 1
    # more sessions -> longer verify cycle -> deeper drafts fit
    assert p.depth_hint(4, 32, draft_ms=5.0, rtt_ms=5.0) > 8
    assert p.depth_hint(2, 32, draft_ms=0.0, rtt_ms=5.0) == p.default_depth


def test_one_session_is_not_capped_below_its_budget():
    """Nobody else's batch to be late for: the edge's own rule picks the depth up to the budget."""
    p = Pacer(min_depth=1, max_depth=12)
    for x in (33, 66, 132, 264):
        p.observe_forward(x, 0.010 + 0.0005 * x)
    assert p.depth_hint(1, 32, draft_ms=5.0, rtt_ms=500.0) == 12
    assert p.depth_hint(1, 4, draft_ms=5.0, rtt_ms=5.0) == 4
    assert p.depth_hint(1, 0, draft_ms=5.0, rtt_ms=5.0) == 0  # "no tree" still means no tree


@pytest.mark.parametrize("draft_ms", [5e-324, 1e-300, 1e-9])
def test_denormal_draft_time_gives_the_deepest_hint_not_an_overflow(draft_ms):
    """Issue 14 #2: int(round(inf)) raised OverflowError and hung the requests of a batch."""
    p = Pacer(min_depth=1, max_depth=12)
    for x in (33, 66, 132, 264):
        p.observe_forward(x, 0.010 + 0.0005 * x)
    assert p.depth_hint(2, 32, draft_ms=draft_ms, rtt_ms=0.0) == 12
    assert p.depth_hint(2, 8, draft_ms=draft_ms, rtt_ms=5e-324) == 8


def test_tree_budget_shrinks_with_load_when_compute_bound():
    p = Pacer(budgets=(8, 16, 32, 64))
    for x in (9, 33, 65, 130, 260, 520, 1040):
        p.observe_forward(x, 0.050 + 0.001 * x)  # CPU-like: every token costs
    for n, tok in ((8, 2.0), (16, 2.4), (32, 2.7), (64, 2.9)):
        for _ in range(20):
            p.observe_round(n, tok)
    few, many = p.budget_hint(1), p.budget_hint(32)
    assert few > many
    assert many == 8


def test_tree_budget_stays_large_when_memory_bound():
    p = Pacer(budgets=(8, 16, 32, 64))
    for x in (9, 33, 65, 130, 260, 520):
        p.observe_forward(x, 0.050 + 0.000001 * x)  # GPU-like: a forward costs the same at any size
    for n, tok in ((8, 2.0), (16, 2.4), (32, 2.7), (64, 2.9)):
        for _ in range(20):
            p.observe_round(n, tok)
    assert p.budget_hint(1) == 64 and p.budget_hint(32) == 64


def test_defaults_before_measurements():
    p = Pacer(default_budget=32, default_depth=4)
    assert p.budget_hint(10) == 32 and p.depth_hint(10, 32, 3.0, 10.0) == 4


def test_a_steeper_measured_cost_curve_gives_a_smaller_budget_down_to_no_tree():
    """Issue 15: the hint comes from the measured curve (flat, then linear) and may be 0."""
    def pacer(slope):
        p = Pacer()
        for rows in (8, 16, 32, 64, 128, 256, 512, 1024):
            p.observe_forward(rows, 0.02 + slope * max(0, rows - 16))
        for n, tok in ((1, 1.5), (2, 1.8), (4, 2.1), (8, 2.4), (16, 2.6), (32, 2.7), (64, 2.8)):
            for _ in range(20):
                p.observe_round(n, tok)
        return p

    hints = [pacer(slope).budget_hint(16) for slope in (0.0, 0.00005, 0.0005, 0.005, 0.05)]
    assert hints == sorted(hints, reverse=True) and hints[0] == 64 and hints[-1] == 0, hints
    assert pacer(0.05).depth_hint(16, 0, draft_ms=3.0, rtt_ms=5.0) == 0


def test_a_no_tree_hint_still_asks_for_a_tree_now_and_then():
    """Without trees, their acceptance is never observed again: every explore_every-th hint
    while the best choice is "no tree" asks for the best tree instead."""
    p = Pacer(explore_every=4)
    for rows in (8, 16, 32, 64, 128):
        p.observe_forward(rows, 0.02 + 0.05 * rows)  # trees cost far more than they bring
    for n in p.budgets:
        for _ in range(5):
            p.observe_round(n, 1.0 if n == 0 else 1.1)
    hints = [p.budget_hint(4) for _ in range(8)]
    assert hints.count(0) == 6 and all(h > 0 for i, h in enumerate(hints) if i % 4 == 3), hints
    # run-ahead asks best_budget at every step: that never explores nor moves the count, so
    # exploration stays one in explore_every replies
    assert all(p.best_budget(4) == 0 for _ in range(9))
    assert [p.budget_hint(4) for _ in range(4)].count(0) == 3


def test_a_session_alone_soon_tries_a_tree_that_nearly_pays_again():
    """The state a full run left one session in (estimates learnt at 4 sessions; its forward
    curve; 3 ms a request): no tree is predicted 3.5 % ahead. If the session's own trees bring
    2 tokens a round, it is on trees within a few replies; several sessions keep exploring one
    in explore_every."""
    def hints(sessions):
        p = Pacer(round_overhead_s=0.003)
        for rows in (1, 2, 3, 4, 8, 16, 32):
            p.observe_forward(rows, 0.0111 + 0.0009 * max(0, rows - 2))
        p._tokens_per_round.update({1: 1.19, 2: 1.19, 4: 1.32, 8: 1.36, 64: 2.54})
        out = []
        for _ in range(64):  # replies; a tree round brings 2 tokens
            out.append(p.budget_hint(sessions, ahead=9))
            if out[-1]:
                p.observe_round(out[-1], 2.0)
        return out

    alone = hints(1)
    assert alone[:3] == [0, 0, 0] and alone[3] > 0 and all(h > 0 for h in alone[16:]), alone
    many = hints(4)
    assert many.count(0) == 62, many


def _flat_then_linear_pacer(overhead_s: float, tokens_per_round) -> Pacer:
    """Budgets 0-4 over the embedded model's measured curve on one core (flat to 3 rows, then
    2.2 ms a row), with the given tokens per round per budget."""
    p = Pacer(budgets=(0, 1, 2, 4), round_overhead_s=overhead_s)
    for rows in (1, 2, 3, 4, 6, 8, 12):
        for _ in range(4):
            p.observe_forward(rows, 0.0165 + 0.0022 * max(0, rows - 3))
    for n, tok in tokens_per_round:
        for _ in range(20):
            p.observe_round(n, tok)
    return p


def test_request_overhead_weighs_against_small_trees_when_run_ahead_amortises_it():
    """Issue 15, 2 sessions: a one-node tree that pays by the forward alone (flat curve up to 3
    rows) does not pay once each request's CPU outside the forward counts and a no-tree request
    brings back 9 tokens (run-ahead); without run-ahead every token is a request either way,
    and the tree still pays. One session: the tree pays in both cases."""
    def pacer(overhead_ms):
        return _flat_then_linear_pacer(overhead_ms / 1000, ((1, 1.3), (2, 1.45), (4, 1.6)))

    assert pacer(0).best_budget(2, ahead=9) > 0  # the forward alone: the tree is almost free
    assert pacer(2.0).best_budget(2, ahead=9) == 0
    assert pacer(2.0).best_budget(2, ahead=1) > 0
    assert pacer(2.0).best_budget(1, ahead=9) > 0
    assert pacer(2.0).budget_hint(2, ahead=9) == 0


def test_tree_forwards_that_carry_fewer_sessions_make_trees_pay_less():
    """Issue 15, 2 sessions: out of step, the sessions' tree rounds shared a forward 1.6 times
    in 2 (measured), so a forward of trees served fewer tokens than the model of both in every
    forward said; run-ahead keeps both in every forward."""
    p = _flat_then_linear_pacer(0.0, ((1, 1.45), (2, 1.6), (4, 1.75)))
    assert p.best_budget(2, ahead=9) > 0
    for _ in range(30):
        p.observe_tree_batch(2, 1 if _ % 3 else 2)
    assert p.best_budget(2, ahead=9) == 0 and p.best_budget(3, ahead=9) > 0  # 3 sessions: not measured


def test_thin_tree_forwards_measured_once_do_not_rule_trees_out_for_good():
    """Tree forwards that carried one of 4 sessions (a cold start's staggered first rounds) made
    trees pay less than run-ahead; from then on every forward had run-ahead steps in it, no forward
    of trees alone refreshed the measure, and trees were out for the replica's life though they
    pay 11 % more. A measure no forward has refreshed in the cost curve's ``stale_forwards`` is
    dropped: the sessions are taken to share a tree forward again until one says otherwise."""
    p = Pacer(round_overhead_s=0.001)
    for rows in (1, 2, 4, 8, 12, 16, 20, 36, 68, 132):
        for _ in range(4):
            p.observe_forward(rows, 0.010 + 0.0004 * rows)
    for n in p.budgets:
        for _ in range(5):
            p.observe_round(n, 1.0 if n == 0 else 1.0 + 0.5 * n ** 0.5)
    warm = p.best_budget(4, ahead=9)
    assert warm > 0
    p.observe_tree_batch(4, 1)
    hints = []
    for _ in range(2 * p.cost.stale_forwards):
        hints.append(p.budget_hint(4, ahead=9))
        if hints[-1] == 0:  # run-ahead, or one exploring tree beside the others' steps: no forward of trees alone
            p.observe_forward(4, 0.010 + 0.0004 * 4)
            p.observe_round(0, 9)
    assert hints[:p.cost.stale_forwards].count(0) > 0.9 * p.cost.stale_forwards
    assert p.best_budget(4, ahead=9) == warm and hints[-1] > 0
    p.observe_tree_batch(4, 1)  # measured again: it counts anew
    assert p.best_budget(4, ahead=9) == 0


def test_sessions_away_longer_than_a_forward_waits_make_trees_pay_less():
    """Full run 20261125-074518 (RTT 100 ms, 4 sessions): trees measured to pay at RTT 0 kept
    being asked for at RTT 100, where each tree round takes a session out of the forwards for
    its whole round trip (forwards carried 3.28 sessions against run-ahead's 4). A session away
    longer than ``fill`` x a forward is in about t / (t + away) of them; run-ahead in all."""
    p = _flat_then_linear_pacer(0.0, ((1, 1.45), (2, 1.6), (4, 1.75)))
    assert p.best_budget(2, ahead=9) > 0 and p.best_budget(2, ahead=9, away_s=0.015) > 0  # within the fill window
    assert p.best_budget(2, ahead=9, away_s=0.100) == 0
    assert p.budget_hint(2, ahead=9, away_s=0.100) == 0
    assert p.best_budget(1, ahead=9, away_s=0.100) > 0  # alone, a session is in every forward it has
    no_fill = _flat_then_linear_pacer(0.0, ((1, 1.45), (2, 1.6), (4, 1.75)))
    no_fill.fill = 0.0  # no batch filling: any time away leaves forwards without the session
    assert no_fill.best_budget(2, ahead=9, away_s=0.015) == 0


def test_one_unlucky_first_round_does_not_rule_a_budget_out():
    """A bucket's first round moves its estimate from what was expected of it: a 4-node tree that
    happened to bring only the bonus token once is still expected to beat 2 nodes."""
    p = Pacer(budgets=(0, 1, 2, 4))
    for _ in range(20):
        p.observe_round(2, 1.8)
    expected = p.expected_tokens(4)
    p.observe_round(4, 1)
    assert p.expected_tokens(2) < p.expected_tokens(4) == pytest.approx(0.8 * expected + 0.2 * 1)


def test_from_two_sessions_a_tree_must_pay_by_the_margin():
    """Zen 4 host, 2 sessions: where the pacer took trees that its model said paid a little,
    `edge_full` read x0.96 of `server_ar` (idle server time and per-request work fall on trees
    alone); on run-ahead x1.07. From 2 sessions up a tree must be predicted ``tree_margin``
    better than no tree; a session alone takes whatever pays."""
    p = _flat_then_linear_pacer(0.0, ((1, 1.3), (2, 1.45), (4, 1.6)))
    best = p.best_budget(2, ahead=9)
    assert best > 0
    rate = p.rates(2, ahead=9)
    gain = rate[best] / rate[0] - 1
    assert 0 < gain < 0.5
    p.tree_margin = gain * 0.9  # the tree pays by more than the margin: taken
    assert p.best_budget(2, ahead=9) == best
    p.tree_margin = gain * 1.1  # by less: no tree
    assert p.best_budget(2, ahead=9) == 0 and p.budget_hint(2, ahead=9) == 0
    assert p.best_budget(1, ahead=9) > 0  # alone: the margin does not apply
    p.tree_margin = 1.0
    assert p.best_budget(1, ahead=9) > 0


def test_a_bucket_no_tree_is_sent_in_any_more_does_not_keep_its_old_estimate():
    """A bucket no tree is sent in any more: 16-node trees brought 3.3 tokens a round early on
    (a real 1-session run's first, uncut trees), then every tree went into the 4-node bucket at
    1.75. The 16-node estimate heals to what the fresh buckets say of it instead of ranking 16
    nodes at 3.3 forever: the hint follows what trees bring now."""
    p = Pacer(budgets=(0, 1, 2, 4, 8, 16))
    for rows in (1, 2, 4, 8, 16, 32):
        p.observe_forward(rows, 0.011 + 0.0004 * rows)
    for _ in range(10):
        p.observe_round(16, 3.3)
    stale = p.expected_tokens(16)
    assert stale > 3.0
    for _ in range(p.stale_rounds):
        p.observe_round(4, 1.75)
    assert p.expected_tokens(16) == pytest.approx(stale)  # refreshed lately enough: kept
    p.observe_round(4, 1.75)
    healed = p.expected_tokens(16)  # the 4-node bucket's rate, scaled by the prior's ratio
    assert healed == pytest.approx(p.expected_tokens(4) * _prior(16) / _prior(4)) and healed < 2.6
    p.observe_round(16, 2.0)  # its next round moves the healed estimate, not the stale one
    assert p.expected_tokens(16) == pytest.approx(0.8 * healed + 0.2 * 2.0)


def _hints_after_a_cold_start(sessions: int, dear: float, replies: int = 8000) -> tuple[Pacer, list[int]]:
    """A replica whose first forward at each row count took ``dear`` times the curve (a cold
    start's first shapes), ``sessions`` sessions following its hints; an ``n``-node tree's rounds
    bring 1 + 0.6 log2(1 + n) tokens on average."""
    p, seen, hints = Pacer(), set(), []
    for _ in range(replies):
        n = p.budget_hint(sessions)
        rows = sessions * (n + 1)
        p.observe_forward(rows, _CURVE(rows) * (1.0 if rows in seen else dear))
        seen.add(rows)
        p.observe_round(n, 1.0 + 0.6 * math.log2(1 + n))
        hints.append(n)
    return p, hints


def _CURVE(rows: float) -> float:
    return 0.010 + 0.0002 * max(0.0, rows - 8)


@pytest.mark.parametrize("sessions", [1, 4])
def test_a_cold_starts_dear_first_forwards_do_not_lock_the_hint(sessions):
    """Each row count's first forward 3x dear: the curve went flat (no size read cheaper than a
    dearer one before), every budget looked the same price, the biggest tree won for good and no
    other size was run again to correct it (2.4x fewer tokens/s at 4 sessions). Every
    ``explore_every``-th hint tries a budget beside the best, stale sizes leave the curve: the hint
    settles where a warm replica's does and the curve is the real one."""
    warm = Counter(_hints_after_a_cold_start(sessions, 1.0)[1][-250:]).most_common(1)[0][0]
    p, hints = _hints_after_a_cold_start(sessions, 3.0)
    assert Counter(hints[-250:]).most_common(1)[0][0] == warm < 64
    assert hints[-250:].count(warm) >= 240
    for rows, mean, _ in p.cost.points():  # the sizes in use (the warm one and those beside it): none dear
        assert mean == pytest.approx(_CURVE(rows), rel=0.01)
    assert sessions * (warm + 1) in [rows for rows, _, _ in p.cost.points()]


def test_a_tree_hint_tries_the_budgets_beside_it_in_turn():
    """While a tree pays best, every ``explore_every``-th hint is a budget beside it: above, then below."""
    def pacer(budgets):
        p = Pacer(budgets=budgets, explore_every=4)
        for rows in (1, 2, 4, 8, 16, 32, 64):
            p.observe_forward(rows, 0.01)  # flat: the biggest tree pays best
        for n in budgets:
            p.observe_round(n, 1.0 + n / 8)
        return p

    p = pacer((0, 1, 2, 4, 8, 16, 32, 64))
    assert p.best_budget(1) == 64
    assert [p.budget_hint(1) for _ in range(12)] == [64, 64, 64, 32] * 3  # 64 has nothing above it
    p = pacer((0, 16, 32, 64, 128))
    for _ in range(4):
        p.observe_forward(129, 0.05)  # 128 costs more than it brings: 64 is best, 32 below it and 128 above
    assert [p.budget_hint(1) for _ in range(8)] == [64, 64, 64, 128, 64, 64, 64, 32]


def test_a_bucket_holds_what_its_trees_bring_after_the_replicas_cut_and_costs_the_rows_verified():
    """Sessions send 16-node trees that the replica cuts to 4 verified nodes (by their confidences):
    the 16-node bucket holds what those rounds bring, so asking for 16 is judged by what it gets,
    and its forward is charged 4 nodes' rows a session, not 16 (a real 1-session run: 9 nodes sent
    under a 16-node hint, 3-5 verified)."""
    def pacer(verified):
        p = Pacer(budgets=(0, 4, 16))
        for rows in (1, 2, 4, 8, 16, 32, 64):
            p.observe_forward(rows, 0.010 + 0.001 * rows)
        for _ in range(30):
            p.observe_round(16, 1.75, verified)
        return p

    cut, uncut = pacer(4), pacer(None)
    assert cut.expected_tokens(16) == pytest.approx(1.75, abs=0.01) == uncut.expected_tokens(16)
    assert cut.state()["verified_nodes"] == {16: pytest.approx(4, abs=0.01)}
    assert cut.rates(2)[16] == pytest.approx(2 * 1.75 / cut.cost.predict(2 * (4 + 1)), rel=1e-3)
    assert cut.rates(2)[16] > uncut.rates(2)[16]


def test_a_class_pacer_shares_the_cost_curve_but_keeps_its_own_estimates_and_their_age():
    """A version's or draft class's pacer (deploy/verifier/versions.py): its rounds neither move the
    base pacer's estimates nor age them."""
    base = Pacer(budgets=(0, 4, 16))
    own = base.with_own_estimates()
    assert own.cost is base.cost
    for _ in range(2 * base.stale_rounds):
        base.observe_round(16, 3.0)
    own.observe_round(16, 1.0)
    own.observe_round(4, 1.5)
    assert base.expected_tokens(16) == pytest.approx(3.0, abs=1e-3)
    assert base.state()["tokens_per_round"] == {16: pytest.approx(3.0, abs=1e-3)}
    assert own.state()["tokens_per_round"].keys() == {4, 16}
