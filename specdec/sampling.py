"""Sampling parameters and the one sampler used everywhere (engine, reference, drafts): every emitted token
consumes exactly one uniform of the session's seeded generator (inverse CDF). Why: docs/specdec.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specdec.errors import InvalidSamplingParams
from specdec.model import native

MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit, vLLM's default max_logprobs)
GREEDY_BELOW = 1e-5  # a temperature under this is greedy (vLLM's _SAMPLING_EPS): logits / 1e-300 overflow


def _integer(name: str, v) -> int:
    """``v`` as an int: an int, or a finite float with no fraction (JSON numbers); never a bool."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidSamplingParams(f"{name} must be an integer, got {v!r}")
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        raise InvalidSamplingParams(f"{name} must be an integer, got {v!r}")
    return int(v)


def _number(name: str, v) -> float:
    """``v`` as a finite float (an int or a float; never a bool, a string, inf or NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidSamplingParams(f"{name} must be a finite number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI/vLLM-style parameters; ``temperature`` under :data:`GREEDY_BELOW` (0 included): greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # vLLM's penalties (specdec/penalties.py): on the raw logits, each position's own history
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # reply with each emitted token's log-prob and this many alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int, max_tokens_limit: int = 1 << 20) -> "SamplingParams":
        def bad(msg):
            raise InvalidSamplingParams(msg)

        if not (0.0 <= self.temperature <= 100.0):  # NaN fails every comparison
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):  # OpenAI's range
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0.0 < self.repetition_penalty <= 100.0):
            bad(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        return self

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        if d is not None and not isinstance(d, dict):
            raise InvalidSamplingParams("sampling must be a JSON object")
        d = dict(d or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise InvalidSamplingParams(f"unknown sampling parameters: {sorted(unknown)}")
        if "stop_token_ids" in d:
            stops = d["stop_token_ids"] or ()
            if not isinstance(stops, (list, tuple)) or len(stops) > 64:
                raise InvalidSamplingParams("stop_token_ids must be a list of at most 64 token ids")
            d["stop_token_ids"] = tuple(_integer("stop_token_ids[]", t) for t in stops)
        for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if k in d:
                d[k] = _number(k, d[k])
        for k in ("top_k", "max_tokens"):
            if k in d:
                d[k] = _integer(k, d[k])
        for k in ("seed", "logprobs"):
            if d.get(k) is not None:
                d[k] = _integer(k, d[k])
        if "ignore_eos" in d and not isinstance(d["ignore_eos"], bool):
            raise InvalidSamplingParams(f"ignore_eos must be true or false, got {d['ignore_eos']!r}")
        return cls(**d)

    def to_dict(self) -> dict:
        return {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "seed": self.seed, "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids), "ignore_eos": self.ignore_eos,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "logprobs": self.logprobs,
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
    logits: [..., vocab] (any float dtype) -> probs: [..., vocab] float32."""
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


def greedy_rows(parts: list[torch.Tensor]) -> list[list[int]]:
    """The argmax of every row of ``parts`` (each [n_i, vocab]), as :func:`greedy_token` picks it, in few launches."""
    if not parts:
        return []
    first, vocab = parts[0], parts[0].shape[-1]
    rows = [p.shape[0] for p in parts]
    at = first.storage_offset()
    one = all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
              for p in parts)
    for p, n in zip(parts, rows):
        one = one and p.storage_offset() == at
        at += n * vocab
    if not one:
        return [p.argmax(-1).tolist() for p in parts]
    ids = first.as_strided((sum(rows), vocab), (vocab, 1), first.storage_offset()).argmax(-1).tolist()  # [R]
    out, at = [], 0
    for n in rows:
        out.append(ids[at: at + n])
        at += n
    return out


def greedy_token(logits: torch.Tensor) -> int:
    """``torch.argmax`` of one logits row [vocab] (first largest; a NaN counts as largest), native on a CPU bf16 row."""
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.dim() == 1:
        lib = native.load()
        if lib is not None:
            row = logits.contiguous()
            return int(lib.glue_argmax_bf16(row.data_ptr(), row.numel()))
    return int(torch.argmax(logits).item())


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from the target at one position. logits: [vocab]."""
    if params.greedy:
        return greedy_token(logits)
    return sample_from_probs(target_probs(logits, params), generator)
