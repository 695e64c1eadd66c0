"""Fixtures shared by the edge-agent tests: the tiny target, a noisy draft of it, an engine
serving it, and its greedy reference output for the shared prompt."""

import pytest

from specdec.engine import VerifierEngine
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.tree import TreeLimits
from tests.edge_agent.helpers import EOS, GREEDY, PROMPT, noisy_copy


@pytest.fixture(scope="module")
def target():
    return tiny_random_model(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    """The target with small weight noise: partial acceptance."""
    return noisy_copy(target, 0.005)


@pytest.fixture(scope="module")
def engine(target):
    return VerifierEngine(target, eos_token_ids=EOS, limits=TreeLimits(max_nodes=64, max_depth=16))


@pytest.fixture(scope="module")
def greedy_ref(target):
    return reference_decode(target, PROMPT, GREEDY, EOS)
