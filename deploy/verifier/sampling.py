"""Sampling parameters and the one sampler used everywhere (engine, reference, drafts).

Every emitted token consumes exactly one uniform draw from the session's seeded
generator (inverse-CDF sampling), whether it is emitted by plain decoding or by a tree
verification round. Hence, with the same seed, speculative decoding reproduces the
target-only sample path, and a re-opened session can fast-forward its generator by
the number of tokens already emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deploy.errors import InvalidSamplingParams


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI/vLLM-style parameters. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int, max_tokens_limit: int = 1 << 20) -> "SamplingParams":
        def bad(msg):
            raise InvalidSamplingParams(msg)

        if not (0.0 <= self.temperature <= 100.0):
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.top_k <= vocab_size):
            bad(f"top_k must be in [0, {vocab_size}], got {self.top_k}")
        if not (1 <= self.max_tokens <= max_tokens_limit):
            bad(f"max_tokens must be in [1, {max_tokens_limit}], got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            bad(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop_token_ids) > 64:
            bad("at most 64 stop_token_ids")
        for t in self.stop_token_ids:
            if not (0 <= t < vocab_size):
                bad(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        return self

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        d = dict(d or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise InvalidSamplingParams(f"unknown sampling parameters: {sorted(unknown)}")
        try:
            if "stop_token_ids" in d:
                d["stop_token_ids"] = tuple(int(t) for t in (d["stop_token_ids"] or ()))
            for k in ("temperature", "top_p"):
                if k in d:
                    d[k] = float(d[k])
            for k in ("top_k", "max_tokens"):
                if k in d:
                    d[k] = int(d[k])
            if d.get("seed") is not None:
                d["seed"] = int(d["seed"])
            if "ignore_eos" in d:
                d["ignore_eos"] = bool(d["ignore_eos"])
        except (TypeError, ValueError) as e:
            raise InvalidSamplingParams(f"malformed sampling parameters: {e}") from None
        return cls(**d)

    def to_dict(self) -> dict:
        return {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "seed": self.seed, "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids), "ignore_eos": self.ignore_eos,
        }


def make_generator(params: SamplingParams, skip: int = 0) -> torch.Generator | None:
    """Per-session generator; ``skip`` fast-forwards past already-emitted tokens."""
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    if skip:
        torch.rand(skip, generator=g, dtype=torch.float64)
    return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed target distribution: temperature, then top-k, then top-p.

    logits: [..., vocab] (any float dtype) -> probs: [..., vocab] float32.
    """
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop_sorted = (cum - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse-CDF sampling with exactly one uniform draw. probs: [vocab]."""
    cdf = torch.cumsum(probs.double(), dim=0)  # [vocab]
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    idx = int(torch.searchsorted(cdf, u.reshape(1), right=True).item())
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] <= 0 and idx > 0:  # never land on a zero-probability token at the boundary
        idx -= 1
    return idx


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from the target at one position. logits: [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    return sample_from_probs(target_probs(logits, params), generator)
