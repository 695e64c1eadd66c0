"""GenerationStats: the summary line."""

from __future__ import annotations


def test_the_summary_line_names_early_frames_and_rejections_only_when_there_were_some():
    from edge_agent.stats import GenerationStats

    plain = GenerationStats(tokens=10, rounds=4, accepted_tokens=6).summary()
    assert "early frames" not in plain and "rejections" not in plain
    pre = GenerationStats(tokens=10, rounds=4, early_frames=4, predraft_hits=1, predraft_misses=3, rejections=2)
    assert "4 early frames, pre-draft hits 1/4, 2 rejections" in pre.summary()
