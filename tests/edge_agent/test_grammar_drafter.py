"""edge_agent/grammar_drafter.py: a drafter's candidates filtered by the grammar after each node's path."""

from __future__ import annotations

import torch

from edge_agent.draft_backends import Drafter, ExpandRequest
from edge_agent.grammar_drafter import GrammarDrafter
from specdec.grammar import GrammarCompiler, GrammarSpec

VOCAB = ["a", "b", "c", "d", "<eos>"]


class Every(Drafter):
    """Proposes every token, best first in id order; q uniform."""

    name = "every"

    def __init__(self):
        self.seen = []

    def expand(self, prefix, reqs, k):
        self.seen.append(list(prefix))
        return [(list(range(min(k, len(VOCAB)))), [-1.0 - t for t in range(min(k, len(VOCAB)))]) for _ in reqs]


def drafter(prompt_len=2):
    compiler = GrammarCompiler(list(VOCAB), len(VOCAB), (4,))
    return GrammarDrafter(Every(), compiler.state(GrammarSpec("regex", "(ab|cd)+")), prompt_len)


def test_candidates_follow_the_grammar_after_each_nodes_path():
    d = drafter()
    prompt = [3, 3]  # the prompt is not the grammar's
    root = ExpandRequest(-1, 3, 0)
    after_a = ExpandRequest(7, 0, 1, (), (0,))
    after_ab = ExpandRequest(8, 1, 2, (7,), (0, 1))
    refused = ExpandRequest(9, 1, 1, (), (1,))  # "b" first: the grammar refuses the path
    out = d.expand(prompt, [root, after_a, after_ab, refused], 3)
    assert [toks for toks, _ in out] == [[0, 2], [1], [0, 2, 4], [0, 1, 2]]  # the refused path: unmasked
    assert out[1][1] == [-2.0]  # the inner drafter's own log-probs


def test_the_verified_prefix_advances_the_state():
    d = drafter()
    d.advance([3, 3, 0, 1], [], [])  # "ab" verified
    (toks, _), = d.expand([3, 3, 0, 1], [ExpandRequest(-1, 1, 0)], 5)
    assert toks == [0, 2, 4]  # another pair, or the end
    (toks, _), = d.expand([3, 3, 0, 1, 2], [ExpandRequest(-1, 2, 0)], 5)
    assert toks == [3]  # "c" verified: "d" must follow


def test_next_logits_are_renormalised_over_what_the_grammar_allows():
    d = drafter()
    (row,) = d.next_logits([3, 3], [ExpandRequest(-1, 3, 0)], len(VOCAB))
    probs = row.exp()
    assert torch.isclose(probs.sum(), torch.tensor(1.0)) and set(torch.nonzero(probs).flatten().tolist()) == {0, 2}
