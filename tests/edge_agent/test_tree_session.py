"""The TreeSession protocol: both tree sessions implement it, with its signatures."""

from __future__ import annotations

import inspect

import pytest

from specdec.sampling import SamplingParams
from edge_agent.draft_backends import NullDrafter
from edge_agent.draft_session import DraftSession
from edge_agent.sampled_tree import SampledTreeSession
from edge_agent.tree_session import TreeSession

SESSIONS = {
    "DraftSession": lambda: DraftSession(NullDrafter()),
    "SampledTreeSession": lambda: SampledTreeSession(NullDrafter(), 16, SamplingParams(temperature=1.0), None),
}
METHODS = [name for name, v in vars(TreeSession).items() if inspect.isfunction(v) and not name.startswith("_")]


@pytest.mark.parametrize("make", SESSIONS.values(), ids=SESSIONS.keys())
def test_each_tree_session_implements_the_protocol_with_its_signatures(make):
    session = make()
    assert isinstance(session, TreeSession)
    assert isinstance(session.forwards, int) and session.forward_times == []
    for name in METHODS:
        want = list(inspect.signature(getattr(TreeSession, name)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(session, name)).parameters) == want, name
