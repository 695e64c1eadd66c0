"""The target-only reference decoder against independent implementations: HF ``generate``
(greedy) and a cache-free full-recompute loop (seeded sampling)."""

from __future__ import annotations

import pytest
import torch

from specdec.reference import reference_decode
from specdec.sampling import SamplingParams, make_generator, sample_token

EOS = 2


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos=EOS) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def full_recompute_sample(model, prompt: list[int], params: SamplingParams, eos=(EOS,)) -> list[int]:
    """No KV cache: the whole sequence through the model for every token."""
    g = make_generator(params)
    seq, out = list(prompt), []
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    with torch.inference_mode():
        while True:
            tok = sample_token(model(torch.tensor([seq])).logits[0, -1].float(), params, g)
            out.append(tok)
            seq.append(tok)
            if tok in stop or len(out) >= params.max_tokens:
                return out


@pytest.mark.parametrize("prompt", [[1], [5, 6, 7], list(range(3, 60, 3))])
def test_greedy_reference_equals_hf_generate(tiny_model, prompt):
    assert reference_decode(tiny_model, prompt, SamplingParams(max_tokens=30), (EOS,)) == hf_greedy(tiny_model, prompt, 30)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=1, max_tokens=25),
                                    SamplingParams(temperature=0.7, top_k=30, top_p=0.9, seed=2, max_tokens=25)])
def test_sampled_reference_equals_cache_free_sampling(tiny_model, params):
    prompt = [4, 8, 15, 16, 23, 42]
    assert reference_decode(tiny_model, prompt, params, (EOS,)) == full_recompute_sample(tiny_model, prompt, params)


def test_same_seed_same_output_and_seeds_differ(tiny_model):
    p = SamplingParams(temperature=1.0, seed=5, max_tokens=20)
    a = reference_decode(tiny_model, [7, 7, 7], p)
    assert a == reference_decode(tiny_model, [7, 7, 7], p)
    assert a != reference_decode(tiny_model, [7, 7, 7], SamplingParams(temperature=1.0, seed=6, max_tokens=20))


def test_stop_tokens_are_emitted_and_end_decoding(tiny_model):
    free = reference_decode(tiny_model, [9, 10], SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free[7]
    first = free.index(stop)
    out = reference_decode(tiny_model, [9, 10], SamplingParams(max_tokens=30, stop_token_ids=(stop,)))
    assert out == free[: first + 1]
    # EOS from the model's ids stops too unless ignore_eos
    assert reference_decode(tiny_model, [9, 10], SamplingParams(max_tokens=30), eos_token_ids=(stop,)) == out
    assert reference_decode(tiny_model, [9, 10], SamplingParams(max_tokens=30, ignore_eos=True),
                            eos_token_ids=(stop,)) == free
    assert len(reference_decode(tiny_model, [9, 10], SamplingParams(max_tokens=4, ignore_eos=True))) == 4
