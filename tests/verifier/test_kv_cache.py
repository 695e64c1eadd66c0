"""Per-session KV: the buffer itself, and rollback through many verify rounds with rejections
(the kept KV equals a fresh prefill of the same tokens)."""

from __future__ import annotations

import random

import pytest
import torch

from deploy.verifier.engine import ChainVerifyRequest, OpenRequest, VerifierEngine
from deploy.verifier.kv_cache import SessionKV
from deploy.verifier.reference import reference_decode
from deploy.verifier.runner import LayerRunner
from deploy.verifier.sampling import SamplingParams
from tests.verifier.test_engine import drive, random_prompt

EOS = 2
KV_TOL = 1e-5  # fp32: the same KV through different forward shapes


def test_append_grows_and_keeps_content():
    kv = SessionKV(num_layers=2, kv_heads=3, head_dim=4, dtype=torch.float32, capacity=2)
    chunks = [torch.randn(2, 3, t, 4) for t in (1, 2, 5, 1)]
    for c in chunks:
        kv.append(c, -c)
    assert kv.length == 9 and kv.capacity >= 9
    assert torch.equal(kv.keys(), torch.cat(chunks, dim=2))
    assert torch.equal(kv.values(), -torch.cat(chunks, dim=2))
    assert kv.nbytes() == 2 * 4 * 2 * 3 * 4 * kv.capacity


def test_truncate_rolls_back_and_later_appends_overwrite():
    kv = SessionKV(1, 1, 2, torch.float32)
    kv.append(torch.ones(1, 1, 5, 2), torch.ones(1, 1, 5, 2))
    kv.truncate(3)
    assert kv.keys().shape == (1, 1, 3, 2)
    kv.append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert kv.keys()[0, 0, :, 0].tolist() == [1, 1, 1, 0]
    with pytest.raises(ValueError):
        kv.truncate(5)
    with pytest.raises(ValueError):
        kv.truncate(-1)


def hf_prefill_kv(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, H, T, d] keys and values of a plain HF forward over ``tokens`` (independent of the runner)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    k = torch.stack([layer.keys[0] for layer in cache.layers])
    v = torch.stack([layer.values[0] for layer in cache.layers])
    return k, v


def test_kv_after_many_rounds_with_rejections_equals_a_fresh_prefill(tiny_model):
    rng = random.Random(31)
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    specs = {f"k{i}": (random_prompt(rng, 512, 1, 40), SamplingParams(max_tokens=60, ignore_eos=True))
             for i in range(4)}
    truths = {sid: reference_decode(tiny_model, p, prm) for sid, (p, prm) in specs.items()}
    eng.open([OpenRequest(sid, p, prm) for sid, (p, prm) in specs.items()])
    rounds = drive(eng, truths, rng, max_rounds=25)  # random trees: mostly partial acceptance
    assert rounds == 25
    for sid in specs:
        s = eng.sessions[sid]
        assert not s.finished and s.num_generated >= 25
        kv = eng.runner.kv[sid]
        assert kv.length == len(s.prefix) - 1  # the invariant: KV holds the prefix minus its root
        k_ref, v_ref = hf_prefill_kv(tiny_model, s.prefix[:-1])
        assert kv.keys().shape == k_ref.shape
        assert (kv.keys() - k_ref).abs().max() < KV_TOL
        assert (kv.values() - v_ref).abs().max() < KV_TOL
        # and equals the runner's own fresh prefill of the same tokens (a re-open)
        fresh = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
        fresh.open([OpenRequest(sid, specs[sid][0], specs[sid][1], generated=tuple(s.prefix[len(specs[sid][0]):]))])
        assert (fresh.runner.kv[sid].keys() - kv.keys()).abs().max() < KV_TOL
        assert (fresh.runner.kv[sid].values() - kv.values()).abs().max() < KV_TOL


def test_chain_mode_rejections_keep_the_kv_exact(tiny_model):
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    prompt = [5, 9, 13, 21]
    eng.open([OpenRequest("c", prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=80, ignore_eos=True))])
    s = eng.sessions["c"]
    g = torch.Generator().manual_seed(0)
    owed = None
    for _ in range(15):
        toks = torch.randint(3, 512, (3,), generator=g).tolist()
        res = eng.verify_chain([ChainVerifyRequest("c", tuple(toks), (0.9, 0.9, 0.9),
                                                   len(s.prefix) + (owed is not None), resampled=owed)])[0]
        owed = int(torch.randint(3, 512, (), generator=g)) if res.bonus is None else None
    pending = 1 if s.awaiting_resample else 0
    kv = eng.runner.kv["c"]
    assert kv.length == len(s.prefix) - 1 + pending
    k_ref, v_ref = hf_prefill_kv(tiny_model, s.prefix[: kv.length])
    assert (kv.keys() - k_ref).abs().max() < KV_TOL and (kv.values() - v_ref).abs().max() < KV_TOL


def test_finished_and_closed_sessions_release_their_kv(tiny_model):
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    eng.open([OpenRequest("a", [5, 6], SamplingParams(max_tokens=1)), OpenRequest("b", [5, 6], SamplingParams())])
    assert eng.sessions["a"].finished and "a" not in eng.runner.kv
    assert eng.kv_tokens() == 2
    eng.close("b")
    assert eng.kv_tokens() == 0 and "b" not in eng.runner.kv


def test_pipeline_slices_hold_their_own_layers(tiny_model):
    """Two runners over layers [0, 1) and [1, 2) (a 2-stage pipeline) keep the same KV as one runner."""
    whole = LayerRunner(tiny_model)
    first, last = LayerRunner(tiny_model, 0, 1), LayerRunner(tiny_model, 1, 2)
    from deploy.verifier.runner import BatchItem

    toks = [5, 6, 7, 8]
    item = BatchItem("s", toks, torch.arange(4), torch.ones(4, 4, dtype=torch.bool).tril(), [3])
    want = whole.forward(0, [item])
    h = first.forward(0, [item])
    got = last.forward(0, [item], hidden=h)
    assert (want[0] - got[0]).abs().max() < 1e-5
    for r in (whole, first, last):
        r.commit(0, {"s": [0, 1, 2, 3]})
    assert torch.equal(torch.cat([first.kv["s"].keys(), last.kv["s"].keys()]), whole.kv["s"].keys())
