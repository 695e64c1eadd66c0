"""The edge's half of chain rejection sampling: a sample of norm(max(0, p - q)) after a rejection (Leviathan et al.
2023, split as in DSSD §3 / PicoSpec §3.3); why it is exact: docs/acceptance.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import sample_from_probs


@dataclass(frozen=True)
class Rejection:
    """What the edge needs after a rejection to sample norm(max(0, p - q)) exactly."""

    head_ids: tuple[int, ...]  # the largest entries of p; all of its support when tail_mass == 0
    head_probs: tuple[float, ...]
    tail_mass: float = 0.0  # p's mass outside the head
    tail_ids: tuple[int, ...] = ()  # i.i.d. samples of p restricted to the tail (proposals)
    tail_probs: tuple[float, ...] = ()  # p(y) of each of them


class ResidualSampler:
    """Samples norm(max(0, p - q)) from a :class:`Rejection` and the edge's full q. :meth:`sample` is None when
    the tail candidates run out: :meth:`extend` with a refill, then sample again. How: docs/specdec.md."""

    def __init__(self, rejection: Rejection, q: torch.Tensor, generator: torch.Generator | None):
        self.q = q.double()  # [vocab] the edge's draft distribution at the rejected position
        self.g = generator
        self.tail_ids: list[int] = []
        self.tail_probs: list[float] = []
        self.reset(rejection)

    def reset(self, rejection: Rejection) -> None:
        """Start over from a whole new rejection of the same position (a re-opened session)."""
        self.ids = torch.tensor(rejection.head_ids, dtype=torch.long)  # [n]
        self.p_head = torch.tensor(rejection.head_probs, dtype=torch.float64)  # [n]
        self.r_head = torch.clamp(self.p_head - self.q[self.ids], min=0.0)  # [n] the head's residual
        self.tail_mass = float(rejection.tail_mass)
        self.tail_ids, self.tail_probs = list(rejection.tail_ids), list(rejection.tail_probs)

    def extend(self, more: Rejection) -> None:
        """Add a refill's tail candidates (:func:`specdec.acceptance.more_candidates`)."""
        self.tail_ids += more.tail_ids
        self.tail_probs += more.tail_probs

    def sample(self) -> int | None:
        """A token of the residual, or None: the tail candidates ran out (ask for more)."""
        z_head, t = float(self.r_head.sum()), self.tail_mass
        if t <= 0.0:  # all of p is known: the residual outright (p == q numerically: p itself)
            return int(self.ids[sample_from_probs(self.r_head if z_head > 0 else self.p_head, self.g)])
        while True:
            u = torch.rand((), generator=self.g, dtype=torch.float64).item()
            if u * (z_head + t) < z_head:
                return int(self.ids[sample_from_probs(self.r_head, self.g)])
            if not self.tail_ids:
                return None
            y, py = self.tail_ids.pop(0), self.tail_probs.pop(0)
            if torch.rand((), generator=self.g, dtype=torch.float64).item() < 1.0 - float(self.q[y]) / py:
                return y


def residual_sample(rejection: Rejection, q: torch.Tensor, generator: torch.Generator | None) -> int | None:
    """Edge half in one call: a sample of norm(max(0, p - q)), or None (ask for more candidates)."""
    return ResidualSampler(rejection, q, generator).sample()
