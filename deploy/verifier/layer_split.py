"""Balanced contiguous split of a decoder's layers over pipeline stages.

Minimises the largest stage cost, by ``"flops"`` or ``"params"`` (docs/verifier.md, "Layer split"). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Weighting = Literal["flops", "params"]


@dataclass(frozen=True)
class LayerCosts:
    """Cost of each decoder layer plus the extra cost of the first and last stage."""

    layers: tuple[float, ...]
    first_extra: float  # embedding
    last_extra: float  # final norm + LM head

    def stage_cost(self, first: int, last: int) -> float:
        n = len(self.layers)
        return (sum(self.layers[first:last]) + (self.first_extra if first == 0 else 0.0)
                + (self.last_extra if last == n else 0.0))


def _get(cfg, name: str, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def layer_costs(config, weighting: Weighting = "flops", context_tokens: int = 1024) -> LayerCosts:
    """Per-layer costs of a Llama-family config (HF config object or dict)."""
    D = int(_get(config, "hidden_size"))
    n = int(_get(config, "num_hidden_layers"))
    H = int(_get(config, "num_attention_heads"))
    KV = int(_get(config, "num_key_value_heads", None) or H)
    d = int(_get(config, "head_dim", None) or D // H)
    inter = int(_get(config, "intermediate_size"))
    V = int(_get(config, "vocab_size"))
    attn_w = D * H * d * 2 + D * KV * d * 2  # q, o + k, v projections
    mlp_w = 3 * D * inter  # gate, up, down
    layer_params = attn_w + mlp_w + 2 * D  # + two RMSNorm weights
    if weighting == "params":
        return LayerCosts((float(layer_params),) * n, float(V * D), float(V * D + D))
    if weighting == "flops":
        per_layer = 2.0 * (attn_w + mlp_w) + 4.0 * context_tokens * H * d
        return LayerCosts((per_layer,) * n, 0.0, 2.0 * D * V)
    raise ValueError(f"unknown weighting {weighting!r}")


def balanced_bounds(costs: LayerCosts, num_stages: int) -> list[int]:
    """Stage boundaries ``[0, b1, ..., n]`` minimising the largest stage cost.
    Each stage gets at least one layer; of such splits the most even (7 equal layers on 3 stages: 3/2/2)."""
    n = len(costs.layers)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers over {num_stages} stages (need 1 <= stages <= layers)")
    prefix = [0.0]
    for c in costs.layers:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int) -> float:
        return (prefix[b] - prefix[a] + (costs.first_extra if a == 0 else 0.0)
                + (costs.last_extra if b == n else 0.0))

    inf = float("inf")

    def solve(objective, limit: float):
        # best[s][j]: optimal objective for layers [0, j) in s stages; cut[s][j]: where stage s starts
        best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for s in range(1, num_stages + 1):
            for j in range(s, n - (num_stages - s) + 1):
                for i in range(s - 1, j):
                    c = cost(i, j)
                    if best[s - 1][i] == inf or c > limit:
                        continue
                    v = objective(best[s - 1][i], c)
                    if v <= best[s][j] * (1 + 1e-12):  # ties: the latest cut, remainder on early stages
                        best[s][j], cut[s][j] = v, i
        return best[num_stages][n], cut

    # 1) the smallest achievable largest stage; 2) among splits within it, the most even one
    m, _ = solve(max, inf)
    _, cut = solve(lambda acc, c: acc + c * c, m * (1 + 1e-9))
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def split_layers(config, num_stages: int, weighting: Weighting = "flops",
                 context_tokens: int = 1024) -> list[tuple[int, int]]:
    """``[(first, last), ...]`` per stage for a model config (see :func:`balanced_bounds`)."""
    b = balanced_bounds(layer_costs(config, weighting, context_tokens), num_stages)
    return list(zip(b[:-1], b[1:]))
