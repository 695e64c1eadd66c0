"""Presence, frequency and repetition penalties as vLLM applies them (OpenAI's; CTRL's, Keskar et al. 2019 §4.1), on
the raw logits before temperature / top-k / top-p; a tree node's history includes its ancestors. Pure torch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.sampling import SamplingParams


class Penalties:
    """One history's token counts; :meth:`apply` penalises a row after ``extra`` more tokens (a node's ancestors)."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], output: Sequence[int], vocab: int,
                 device: torch.device | str = "cpu"):
        self.params = params
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # [vocab] generated-token counts
        if output:
            self.counts.index_add_(0, torch.as_tensor(list(output), device=device),
                                   torch.ones(len(output), device=device))
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)  # [vocab]
        if prompt:
            self.in_prompt[torch.as_tensor(list(prompt), device=device)] = True

    def apply(self, logits: torch.Tensor, extra: Sequence[int] = ()) -> torch.Tensor:
        """logits: [vocab] (any float dtype) -> [vocab] float32, penalised."""
        p = self.params
        counts = self.counts
        if extra:
            counts = counts.clone().index_add_(0, torch.as_tensor(list(extra), device=counts.device),
                                               torch.ones(len(extra), device=counts.device))
        x = logits.float()
        if p.repetition_penalty != 1.0:
            seen = self.in_prompt | (counts > 0)  # [vocab]
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if p.frequency_penalty:
            x = x - p.frequency_penalty * counts
        if p.presence_penalty:
            x = x - p.presence_penalty * (counts > 0).float()
        return x


def penalties_for(params: SamplingParams, prompt: Sequence[int], output: Sequence[int], vocab: int,
                  device: torch.device | str = "cpu") -> Penalties | None:
    """The session's :class:`Penalties`, or None when its params penalise nothing."""
    return Penalties(params, prompt, output, vocab, device) if params.penalized else None
