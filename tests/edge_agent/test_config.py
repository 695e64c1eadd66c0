"""AgentConfig: the defaults are valid, and a bad mode, rule, guess count or depth policy is refused."""

from __future__ import annotations

import pytest

from edge_agent.config import MAX_GUESSES, AgentConfig


def test_the_defaults_are_valid():
    cfg = AgentConfig()
    assert (cfg.mode, cfg.verify, cfg.guesses, cfg.depth_policy) == ("proactive", "match", 0, "auto")


@pytest.mark.parametrize("bad", [dict(mode="eager"), dict(verify="accept-all"), dict(guesses=-1),
                                 dict(guesses=MAX_GUESSES + 1), dict(depth_policy="deepest")])
def test_a_bad_setting_is_refused(bad):
    with pytest.raises(ValueError):
        AgentConfig(**bad)
