"""The edge's residual sampler on hand-made rejections (its exactness against the server's
replies: tests/specdec/test_acceptance.py)."""

from __future__ import annotations

import torch

from specdec.residual import Rejection, ResidualSampler, residual_sample


def test_residual_sample_support():
    g = torch.Generator().manual_seed(0)
    rej = Rejection((0, 1, 2), (0.5, 0.3, 0.2))
    q = torch.tensor([0.6, 0.1, 0.2, 0.1])  # residual: only token 1 has p > q
    assert {residual_sample(rej, q, g) for _ in range(50)} == {1}
    same = torch.tensor([0.5, 0.3, 0.2, 0.0])  # p == q: fall back to p itself
    assert {residual_sample(rej, same, g) for _ in range(200)} <= {0, 1, 2}
    # head (0, 1) and a tail candidate 3 that q covers entirely: only the head's residual or None
    rej = Rejection((0, 1), (0.5, 0.3), 0.2, (3,), (0.2,))
    q = torch.tensor([0.3, 0.3, 0.2, 0.2])
    out = {residual_sample(rej, q, g) for _ in range(200)}
    assert out <= {0, None} and 0 in out
    sampler = ResidualSampler(Rejection((0,), (0.5,), 0.5, (), ()), torch.tensor([0.5, 0.0, 0.5]), g)
    assert sampler.sample() is None  # no head residual, no candidate yet: ask for more
    sampler.extend(Rejection((), (), 0.5, (1,), (0.4,)))
    assert sampler.sample() == 1  # q(1) = 0: the candidate is accepted w.p. 1 - q/p = 1
