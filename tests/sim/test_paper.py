"""sim/paper.py: SpecEdge's comparison, each figure the mean over its seeds."""

from __future__ import annotations

import pytest

from sim.cost_profile import CostProfile
from sim.paper import HERE, compare


def test_each_figure_is_the_mean_over_the_seeds():
    from sim.__main__ import load_app

    app, profile = load_app(HERE / "deploy-8b-h100.yaml"), CostProfile.load(HERE / "profiles" / "llama3-8b-h100.json")
    one = [compare(app, profile, [2], 0.7, seed=k)[0] for k in (0, 1)]
    both = compare(app, profile, [2], 0.7, seed=0, seeds=2)[0]
    for k in ("edge_tokens_per_s", "server_tokens_per_s", "edge_itl_ms_p50", "edge_tokens_per_round"):
        assert both[k] == pytest.approx((one[0][k] + one[1][k]) / 2)
    assert one[0]["edge_tokens_per_s"] != one[1]["edge_tokens_per_s"]  # the seeds differ
    assert both["throughput_ratio"] == pytest.approx(both["edge_tokens_per_s"] / both["server_tokens_per_s"])
