"""Fixtures shared by the edge-agent tests: the tiny target and a noisy draft of it."""

import pytest

from specdec.model.loading import tiny_random_model
from tests.edge_agent.helpers import noisy_copy


@pytest.fixture(scope="module")
def target():
    return tiny_random_model(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    """The target with small weight noise: partial acceptance."""
    return noisy_copy(target, 0.005)
