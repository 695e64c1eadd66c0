"""The paged KV pool: pages, in-place writes, commit/rollback, accounting; and through the
engine, KV after many rounds with rejections equals a fresh prefill of the same tokens."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import KVCapacityExceeded
from specdec.model.batch import chunk_input
from specdec.engine import ChainVerifyRequest, OpenRequest, VerifierEngine
from specdec.model.kv_pool import KVPool
from specdec.model.native import PAGE_SIZE
from specdec.reference import reference_decode
from specdec.model.runner import ModelRunner
from specdec.sampling import SamplingParams
from tests.specdec.test_engine import drive, random_prompt

EOS = 2
KV_TOL = 1e-5  # fp32: the same KV through different forward shapes


def _fill(pool: KVPool, sid: str, start: int, n: int) -> torch.Tensor:
    """Write n entries whose values encode their logical position; returns them [n, H, d]."""
    pool.reserve(sid, start + n)
    vals = torch.arange(start, start + n, dtype=torch.float32)[:, None, None].expand(n, pool.kv_heads, pool.head_dim)
    where = pool.locate(pool.slots(sid, torch.arange(start, start + n)))
    for layer in range(pool.num_layers):
        pool.write(layer, where, vals + 1000 * layer, -vals)
    return vals


def test_pages_are_reserved_written_in_place_and_returned():
    pool = KVPool(num_layers=2, kv_heads=3, head_dim=4, capacity_tokens=10 * PAGE_SIZE, dtype=torch.float32)
    _fill(pool, "a", 0, 20)
    pool.commit("a", 20, [])
    assert pool.length("a") == 20 and pool.pages_in_use == 2 and pool.tokens == 20
    k, v = pool.read("a")
    assert k.shape == (2, 3, 20, 4)
    assert torch.equal(k[1, 0, :, 0], torch.arange(20.0) + 1000) and torch.equal(v[0, 2, :, 3], -torch.arange(20.0))
    _fill(pool, "b", 0, 3)
    pool.commit("b", 3, [])
    pool.release("a")
    pool.release("b")
    assert pool.pages_in_use == 0 and pool.tokens == 0


def test_commit_keeps_the_root_and_moves_the_accepted_path_down():
    pool = KVPool(1, 1, 2, 8 * PAGE_SIZE, torch.float32)
    _fill(pool, "s", 0, 30)
    pool.commit("s", 30, [])
    _fill(pool, "s", 30, 12)  # root at 30, tree nodes at 31..41
    pool.commit("s", 1, [33, 36, 40])  # the accepted path: three nodes, moved to 31, 32, 33
    k, _ = pool.read("s")
    assert k[0, 0, :, 0].tolist() == list(range(31)) + [33.0, 36.0, 40.0]
    assert pool.length("s") == 34 and pool.pages_in_use == 3  # pages past the new length are back
    pool.reserve("s", 40)
    pool.abort("s")  # rollback: nothing committed, the extra page is returned
    assert pool.length("s") == 34 and pool.pages_in_use == 3
    pool.truncate("s", 10)
    assert pool.length("s") == 10 and pool.pages_in_use == 1
    with pytest.raises(ValueError):
        pool.truncate("s", 11)


def test_a_full_pool_refuses_clearly_and_leaves_other_sessions_intact():
    pool = KVPool(1, 1, 2, 2 * PAGE_SIZE, torch.float32)
    _fill(pool, "a", 0, PAGE_SIZE + 1)
    pool.commit("a", PAGE_SIZE + 1, [])
    with pytest.raises(KVCapacityExceeded, match="KV pool full"):
        pool.reserve("b", 1)
    assert "b" not in pool.sessions and pool.length("a") == PAGE_SIZE + 1


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
        k, v = eng.runner.session_kv(sid)
        assert k.shape[2] == len(s.prefix) - 1  # the invariant: KV holds the prefix minus its root
        k_ref, v_ref = hf_prefill_kv(tiny_model, s.prefix[:-1])
        assert k.shape == k_ref.shape
        assert (k - k_ref).abs().max() < KV_TOL and (v - v_ref).abs().max() < KV_TOL
        # and equals the engine's own fresh prefill of the same tokens (a re-open)
        fresh = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
        fresh.open([OpenRequest(sid, specs[sid][0], specs[sid][1], generated=tuple(s.prefix[len(specs[sid][0]):]))])
        fk, fv = fresh.runner.session_kv(sid)
        assert (fk - k).abs().max() < KV_TOL and (fv - v).abs().max() < KV_TOL
    for sid in specs:
        eng.close(sid)
    assert eng.runner.pool.pages_in_use == 0 and eng.kv_tokens() == 0  # usage returns to zero


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
    k, v = eng.runner.session_kv("c")
    assert k.shape[2] == len(s.prefix) - 1 + pending
    k_ref, v_ref = hf_prefill_kv(tiny_model, s.prefix[: k.shape[2]])
    assert (k - k_ref).abs().max() < KV_TOL and (v - v_ref).abs().max() < KV_TOL


def test_finished_and_closed_sessions_release_their_kv(tiny_model):
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    eng.open([OpenRequest("a", [5, 6], SamplingParams(max_tokens=1)), OpenRequest("b", [5, 6], SamplingParams())])
    assert eng.sessions["a"].finished and eng.runner.session_kv("a") is None
    assert eng.kv_tokens() == 2
    eng.close("b")
    assert eng.kv_tokens() == 0 and eng.runner.pool.pages_in_use == 0


def test_a_session_closed_while_its_forward_runs_stays_closed(tiny_model):
    """commit() after a drop must not re-create the session's KV (a DELETE racing a verify)."""
    r = ModelRunner(tiny_model)
    r.forward(0, [chunk_input("s", 0, [5, 6, 7])])
    r.drop("s")
    r.commit(0, {"s": (3, [])})
    assert r.session_kv("s") is None and r.pool.pages_in_use == 0


def test_pipeline_slices_hold_their_own_layers(tiny_model):
    """Two runners over layers [0, 1) and [1, 2) (a 2-stage pipeline) keep the same KV as one runner."""
    whole = ModelRunner(tiny_model)
    first, last = ModelRunner(tiny_model, 0, 1), ModelRunner(tiny_model, 1, 2)
    item = chunk_input("s", 0, [5, 6, 7, 8])
    want = whole.forward(0, [item])
    h = first.forward(0, [item])
    got = last.forward(0, [item], hidden=h)
    assert torch.equal(want[0], got[0])
    for r in (whole, first, last):
        r.commit(0, {"s": (4, [])})
    k = torch.cat([first.session_kv("s")[0], last.session_kv("s")[0]])
    assert torch.equal(k, whole.session_kv("s")[0])
