"""sim/users.py: a simulated user chooses its trees with the edge agent's own classes (its depth
policy on its own telemetry, its budget under the server's hints), or as the load test's Locust
user does."""

from __future__ import annotations

import math

import pytest

from edge_agent.depth import DepthPolicy, Telemetry
from loadtests.synthetic_tree import AcceptanceModel
from sim.users import EdgeUser, confidences
from specdec.truncation import encode_confidence
from tests.sim.test_system import simulate

SLOW_EDGE = {"devices": {"slow": 1.0}, "draft_ms": {"slow": 100.0}, "acceptance": {"alpha": 0.3, "sibling_alpha": 0.1}}


@pytest.fixture
def shapes(monkeypatch):
    """(nodes, depth) of every tree the users choose, and the users."""
    seen, users = [], []
    shape, init = EdgeUser._tree_shape, EdgeUser.__init__

    def recorded(self, *args):
        out = shape(self, *args)
        seen.append(out)
        return out

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        users.append(self)

    monkeypatch.setattr(EdgeUser, "_tree_shape", recorded)
    monkeypatch.setattr(EdgeUser, "__init__", kept)
    return seen, users


def test_a_slow_edge_drafts_as_shallow_as_its_agents_depth_rule_says_not_as_deep_as_the_hint(shapes):
    """One session alone is hinted its whole budget (12 levels); the agent takes the hint for a
    generation's first tree, then its FlexSpec rule, on what it measured (100 ms a draft forward, 30 %
    acceptance), drafts one level (0: the last token, decoded by the server)."""
    seen, users = shapes
    out, _ = simulate(0, users=1, **SLOW_EDGE)
    (user,) = users
    assert type(user.policy) is DepthPolicy and user.policy.kind == "auto" and type(user.telemetry) is Telemetry
    assert user.telemetry.draft_ms.get() == pytest.approx(100.0, rel=0.2) and user.telemetry.rtt_ms.value is not None
    depths = [d for _, d in seen]
    assert set(depths) == {0, 1, 12} and depths.count(1) > 0.7 * len(depths)
    assert out["diverged_rounds"] == 0


def test_the_server_depth_policy_follows_the_hint(shapes):
    seen, _ = shapes
    simulate(0, users=1, depth_policy="server", **SLOW_EDGE)
    assert max(d for _, d in seen) > 1


def test_the_agents_budget_caps_the_servers_budget_hint(shapes):
    seen, _ = shapes
    simulate(0, users=2, budget=4)
    assert seen and max(n for n, _ in seen) <= 4


@pytest.mark.parametrize("hint", [0, 4])
def test_the_agents_own_tree_size_is_capped_by_the_servers_budget_hint(shapes, monkeypatch, hint):
    """A workload's ``nodes`` is the tree the agent's builder makes; the hint caps it, and 0 means no tree."""
    from deploy.verifier.pacing import Pacer

    monkeypatch.setattr(Pacer, "budget_hint", lambda self, *args, **kwargs: hint)
    seen, _ = shapes
    out, _ = simulate(0, users=2, nodes=9)
    assert seen and max(n for n, _ in seen) == hint and out["diverged_rounds"] == 0
    assert (max(d for _, d in seen) == 0) == (hint == 0)


def test_a_locust_user_takes_the_hints_and_pings_nothing(shapes):
    seen, users = shapes
    simulate(0, users=1, client="loadtest", **SLOW_EDGE)
    assert max(d for _, d in seen) > 1 and users[0].telemetry.rtt_ms.value is None


def test_the_agents_open_reports_its_telemetry_and_promises_a_run_ahead_first_request(monkeypatch):
    """As edge_agent.link does: the open's client info carries the agent's measured draft ms and RTT,
    and ``run_ahead`` (its first request may be run ahead: the replica decodes on from the first
    token, detached); a Locust user's carries its configured figures and no such promise."""
    from deploy.router.ingress import Router

    raw = next(c for c in Router.func_or_class.__mro__[1:] if c.__name__ == "Router")
    clients = []
    real_open = raw.open

    async def open_(self, tenant, body, **kwargs):
        clients.append(dict(body["client"]))
        return await real_open(self, tenant, body, **kwargs)

    monkeypatch.setattr(raw, "open", open_)
    simulate(0, users=1, **SLOW_EDGE)
    assert clients and all(c["run_ahead"] is True for c in clients)
    assert clients[-1]["draft_ms"] == pytest.approx(100.0, rel=0.2) and clients[0]["rtt_ms"] > 0  # pinged first
    clients.clear()
    simulate(0, users=1, client="loadtest", **SLOW_EDGE)
    assert clients and all("run_ahead" not in c and c["draft_ms"] == 100.0 for c in clients)


def test_the_agents_confidences_are_its_paths_draft_probabilities():
    """A node's byte is its path's log-probability: a first guess ``alpha``, a second ``(1 - alpha) *
    sibling_alpha``, a third ``(1 - sibling_alpha)`` of that (as the agent's draft would rank them)."""
    a, b = 0.7, 0.3
    got = confidences([-1, 0, 0, 0, -1], AcceptanceModel(a, b))
    want = [math.log(a), 2 * math.log(a), math.log(a) + math.log((1 - a) * b),
            math.log(a) + math.log((1 - a) * b * (1 - b)), math.log((1 - a) * b)]
    assert got == [encode_confidence(x) for x in want]


def test_the_agents_trees_carry_confidences_and_the_replica_truncates_by_them(monkeypatch):
    """On this CPU's profile (a tree row costs 0.6 ms) the replica cuts a lone edge's trees' low-value
    tail by the agent's confidences (the match rule's gains), as it did in the measured runs (4.0-5.3
    of 6.3-7.1 nodes verified a round); a tree sent without them is cut by depth alone, less. The
    edge takes no run-ahead replies here: for a session alone run-ahead and trees rate within 10 %
    of each other (docs/simulation.md), and a seed that runs ahead sends few trees to cut."""
    from deploy.verifier.server import VerifierServer
    from sim.__main__ import simulate as simulate_case
    from sim.cost_profile import CostProfile
    from sim.validate import HERE, RUNS, bench_case, merge_runs

    runs = merge_runs([HERE / f for f in RUNS])
    row = next(r for r in runs["rows"] if r["mode"] == "edge_full" and r["sessions"] == 1)
    app, workload = bench_case(row, {**runs["conditions"], "rows": runs["rows"]})
    workload = workload.model_copy(update={"generations_per_user": 4, "run_ahead": False})
    profile = CostProfile.load(HERE / "verify-step-cpu.json")
    kept = {}
    real_truncate = VerifierServer._truncate

    def truncate(self, trees, base_rows):
        out = real_truncate(self, trees, base_rows)
        for (p, _), (_, r) in zip(trees, out):
            kept.setdefault("sent", []).append(len(p.payload.req.tree))
            kept.setdefault("verified", []).append(len(r.tree) if r.limit is None else r.limit)
        return out

    monkeypatch.setattr(VerifierServer, "_truncate", truncate)
    simulate_case(app, profile, workload, 0)
    with_conf = sum(kept["verified"]) / sum(kept["sent"])
    kept.clear()
    monkeypatch.setattr("sim.users.confidences", lambda parents, model: None)
    simulate_case(app, profile, workload, 0)
    assert with_conf < 0.95 and with_conf < sum(kept["verified"]) / sum(kept["sent"])
