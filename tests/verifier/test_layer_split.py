"""Balanced layer split: optimal largest stage, even ties, embedding/head placement."""

from __future__ import annotations

import itertools
import random

import pytest

from deploy.verifier.layer_split import LayerCosts, balanced_bounds, layer_costs, split_layers

# SmolLM2-135M-Instruct (the embedded target): 30 layers, tied 49,152 x 576 head
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)


def _brute_force_max(costs: LayerCosts, stages: int) -> float:
    n = len(costs.layers)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = (0, *cuts, n)
        best = min(best, max(costs.stage_cost(x, y) for x, y in zip(b, b[1:])))
    return best


@pytest.mark.parametrize("n,stages", [(5, 2), (6, 3), (7, 3), (30, 4), (80, 8), (4, 4)])
def test_equal_layers_split_evenly_with_remainder_first(n, stages):
    b = balanced_bounds(LayerCosts((1.0,) * n, 0.0, 0.0), stages)
    sizes = [y - x for x, y in zip(b, b[1:])]
    assert b[0] == 0 and b[-1] == n and len(sizes) == stages
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # remainder on the early stages


def test_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = LayerCosts(tuple(rng.uniform(0.1, 5) for _ in range(n)), rng.uniform(0, 6), rng.uniform(0, 6))
        b = balanced_bounds(costs, stages)
        got = max(costs.stage_cost(x, y) for x, y in zip(b, b[1:]))
        assert all(y > x for x, y in zip(b, b[1:]))
        assert got == pytest.approx(_brute_force_max(costs, stages), rel=1e-9)


def test_head_counts_on_the_last_stage():
    flops = layer_costs(SMOLLM2, "flops", context_tokens=0)
    assert flops.first_extra == 0  # an embedding lookup computes nothing
    assert flops.last_extra == pytest.approx(2 * 576 * 49152)
    # the LM head costs ~8 layers: the last stage gets far fewer layers
    (a0, b0), (a1, b1) = split_layers(SMOLLM2, 2, "flops", context_tokens=0)
    assert (a0, b1) == (0, 30) and b0 == a1
    assert b0 - a0 == 19 and b1 - a1 == 11
    stage = [flops.stage_cost(a0, b0), flops.stage_cost(a1, b1)]
    assert max(stage) / min(stage) < 1.1


def test_params_weighting_counts_embedding_first_and_head_last():
    params = layer_costs(SMOLLM2, "params")
    total = sum(params.layers) + params.first_extra + params.last_extra
    # tied embeddings are counted twice (each end holds a copy); the model itself has 134.5M
    assert total - 576 * 49152 == pytest.approx(134.5e6, rel=0.01)
    slices = split_layers(SMOLLM2, 2, "params")
    assert [b - a for a, b in slices] == [15, 15]  # symmetric: embedding first, head last


def test_every_layer_in_exactly_one_stage():
    for stages in range(1, 9):
        slices = split_layers(SMOLLM2, stages)
        owned = [i for a, b in slices for i in range(a, b)]
        assert owned == list(range(30))


def test_invalid_stage_counts():
    with pytest.raises(ValueError):
        balanced_bounds(LayerCosts((1.0,) * 3, 0, 0), 4)
    with pytest.raises(ValueError):
        balanced_bounds(LayerCosts((1.0,) * 3, 0, 0), 0)
    with pytest.raises(ValueError):
        layer_costs(SMOLLM2, "bytes")  # type: ignore[arg-type]
