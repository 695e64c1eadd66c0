"""Automatic prefix caching: the page index, the pool's shared pages, and through the engine,
output and KV exactly as without it (bf16: batch invariance makes a cached page the same bits).
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import KVCapacityExceeded
from specdec.model.batch import chunk_input
from specdec.engine import OpenRequest, Session, VerifierEngine, VerifyRequest
from specdec.model.kv_pool import KVPool
from specdec.model.loading import tiny_random_model
from specdec.model.native import PAGE_SIZE as PS
from specdec.model.prefix_cache import PrefixCache
from specdec.model.runner import ModelRunner
from specdec.sampling import SamplingParams
from tests.specdec.test_engine import random_prompt, random_tree
from tests.specdec.model.test_kv_pool import _fill


# -- the index ---------------------------------------------------------------------------------
def test_the_longest_cached_prefix_matches_whole_pages_within_one_salt():
    c = PrefixCache(4)
    a = list(range(10))  # pages [0..3], [4..7]; 8, 9 are not a whole page
    c.add([7, 3, 9], a, salt="t1")
    assert c.cached_pages == 2 and not c.cached(9)
    assert c.match(a, "t1", max_pages=8) == [7, 3]
    assert c.match(a[:4] + [99, 5, 6, 7], "t1", 8) == [7]  # the second page differs
    assert c.match([1] + a[1:], "t1", 8) == []  # so does the first: nothing below it matches
    assert c.match(a, "t2", 8) == []  # another tenant's prompt is never shared
    assert c.match(a, "t1", max_pages=1) == [7]


def test_idle_pages_are_evicted_least_recently_released_first_and_their_children_never_match():
    c = PrefixCache(2)
    c.add([0, 1, 2], [1, 2, 3, 4, 5, 6], salt=None)  # one session holds 0, 1, 2
    assert c.evict() is None  # all held
    for page in (2, 1, 0):  # released deepest first, as the pool does
        assert c.release(page)
    assert c.idle_pages == 3 and not c.release(42)  # 42 is not cached: the caller frees it
    assert c.evict() == 2
    assert c.match([1, 2, 3, 4, 5, 6], None, 3) == [0, 1]  # held again: no longer idle
    assert c.idle_pages == 0
    for page in (1, 0):
        c.release(page)
    assert c.evict() == 1 and c.evict() == 0 and c.evict() is None
    c.add([5], [1, 2], None)  # a new page 0 prefix: its id is new
    assert c.match([1, 2, 3, 4], None, 2) == [5]  # the old second page's key named the evicted id


# -- the pool ----------------------------------------------------------------------------------
def _pool(pages: int) -> KVPool:
    return KVPool(1, 1, 2, pages * PS, torch.float32, prefix_caching=True)


def test_a_shared_page_is_read_by_both_sessions_and_written_by_neither():
    pool = _pool(8)
    toks = list(range(3 * PS))
    _fill(pool, "a", 0, 2 * PS + 3)
    pool.commit("a", 2 * PS + 3, [])
    pool.cache("a", toks)
    assert pool.share("b", toks[: 2 * PS + 1]) == 2 * PS  # both whole pages; one token left to compute
    assert pool.share("c", toks[: 2 * PS]) == PS  # at least one token is always computed
    assert pool.pages_in_use == 3  # a's three pages; b and c hold shared ones only
    _fill(pool, "b", 2 * PS, 5)  # b's own next page
    pool.commit("b", 5, [])
    assert torch.equal(pool.read("b")[0][..., : 2 * PS, :], pool.read("a")[0][..., : 2 * PS, :])
    pool.release("a")
    assert pool.pages_in_use == 3 and pool.length("b") == 2 * PS + 5  # a's last page went back
    pool.release("b")
    pool.release("c")
    assert pool.pages_in_use == 0 and pool.prefix_cache.idle_pages == 2


def test_a_full_pool_reuses_idle_cached_pages_and_refuses_only_when_none_is_left():
    pool = _pool(3)
    _fill(pool, "a", 0, 2 * PS)
    pool.commit("a", 2 * PS, [])
    pool.cache("a", list(range(2 * PS)))
    pool.release("a")
    assert pool.pages_free == 3 and pool.pages_in_use == 0
    _fill(pool, "b", 0, 2 * PS)  # one free page, then the idle deepest page
    pool.commit("b", 2 * PS, [])
    assert pool.share("c", list(range(2 * PS))) == PS  # its first page survived
    with pytest.raises(KVCapacityExceeded):
        pool.reserve("d", PS + 1)
    assert pool.length("b") == 2 * PS and pool.length("c") == PS


def test_truncating_into_a_cached_page_copies_it_first():
    pool = _pool(6)
    _fill(pool, "a", 0, 2 * PS)
    pool.commit("a", 2 * PS, [])
    pool.cache("a", list(range(2 * PS)))
    before = pool.read("a")[0].clone()
    assert pool.share("b", list(range(2 * PS)) + [0]) == 2 * PS
    pool.truncate("b", PS + 3)  # b will write at PS + 3: inside a's second page
    pool.reserve("b", PS + 4)
    where = pool.locate(pool.slots("b", torch.tensor([PS + 3])))
    pool.write(0, where, torch.full((1, 1, 2), -7.0), torch.full((1, 1, 2), -7.0))
    pool.commit("b", 1, [])
    assert torch.equal(pool.read("a")[0], before)
    assert pool.read("b")[0][0, 0, PS + 3, 0] == -7.0 and torch.equal(pool.read("b")[0][..., : PS + 3, :],
                                                                     before[..., : PS + 3, :])


def test_a_runner_without_prefix_caching_shares_nothing(tiny_model):
    runner = ModelRunner(tiny_model, kv_capacity_tokens=4 * PS)
    runner.forward(0, [chunk_input("a", 0, list(range(2 * PS)), [])])
    runner.commit(0, {"a": (2 * PS, [])})
    runner.cache_prefix("a", list(range(2 * PS)))
    assert runner.share_prefix("b", list(range(2 * PS + 1))) == 0 and runner.prefix_stats() is None


# -- through the engine ------------------------------------------------------------------------
def _run(eng: VerifierEngine, prompts: dict[str, list[int]], rng: random.Random, salt: dict | None = None,
         max_tokens: int = 24) -> dict[str, list[int]]:
    """Open ``prompts`` (prefill in random chunks, beside each other), decode them with random
    trees in random batches to the end; each session's generated tokens."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    assert eng.begin_open([OpenRequest(sid, p, params, cache_salt=(salt or {}).get(sid))
                           for sid, p in prompts.items()]) == [None] * len(prompts)
    out: dict[str, list[int]] = {}
    while eng.prefilling:
        for res in eng.prefill_step(rng.randint(1, 64)):
            out[res.sid] = [res.first_token]
    while any(not eng.sessions[sid].finished for sid in prompts):
        live = [sid for sid in prompts if not eng.sessions[sid].finished]
        batch = rng.sample(live, rng.randint(1, len(live)))
        reqs = [VerifyRequest(sid, random_tree(rng, [], eng.vocab_size, 12, 4), len(eng.sessions[sid].prefix))
                for sid in batch]
        for req, res in zip(reqs, eng.verify(reqs)):
            out[req.sid] += list(res.tokens)
    for sid in prompts:
        eng.close(sid)
    return out


@pytest.fixture(scope="module")
def bf16_model():
    return tiny_random_model(seed=3, dtype=torch.bfloat16)


@pytest.mark.parametrize("seed", range(3))
def test_bf16_output_with_prefix_caching_is_the_output_without_it(bf16_model, seed):
    """Prompts that share a system prompt and earlier turns (a follow-up prompt holds a finished
    session's whole output), opened beside each other: the same tokens as an engine without
    prefix caching, and most of their prompt tokens came from the cache."""
    rng = random.Random(seed)
    V = bf16_model.config.vocab_size
    system = random_prompt(rng, V, 2 * PS, 4 * PS)
    prompts = {f"p{i}": system + random_prompt(rng, V, 1, 3 * PS) for i in range(4)}
    plain = VerifierEngine(bf16_model, kv_capacity_tokens=1 << 12)
    cached = VerifierEngine(bf16_model, kv_capacity_tokens=1 << 12, prefix_caching=True)
    first = _run(plain, dict(prompts), random.Random(seed))
    assert _run(cached, dict(prompts), random.Random(seed)) == first
    turn2 = {f"t{i}": p + first[f"p{i}"] + random_prompt(rng, V, 1, PS) for i, p in enumerate(prompts.values())}
    turn2["fresh"] = random_prompt(rng, V, PS, 3 * PS)
    assert _run(cached, turn2, random.Random(seed + 1)) == _run(plain, turn2, random.Random(seed + 1))
    st = cached.prefix_cache_stats()
    assert plain.prefix_cache_stats() is None
    whole = sum(len(p) for p in turn2.values()) - len(turn2["fresh"])
    assert st["hit_tokens"] >= 0.6 * whole, st  # the turns' prompts and the first outputs, in whole pages
    assert cached.kv_used_tokens() == 0 and st["idle_pages"] == st["cached_pages"] > 0  # nothing held, all cached


def test_the_kv_of_cached_pages_equals_a_fresh_prefill_bit_for_bit(bf16_model):
    """A session decoded with trees, then closed: a prompt holding its whole sequence starts on
    its pages; the K/V it holds are the bits one plain prefill of the same tokens writes."""
    rng = random.Random(7)
    V = bf16_model.config.vocab_size
    prompt = random_prompt(rng, V, PS + 3, PS + 3)
    eng = VerifierEngine(bf16_model, kv_capacity_tokens=1 << 12, prefix_caching=True)
    seq = prompt + _run(eng, {"a": prompt}, rng, max_tokens=2 * PS)["a"] + [5]
    fresh = VerifierEngine(bf16_model, kv_capacity_tokens=1 << 12)
    for e in (eng, fresh):
        assert e.open([OpenRequest("b", seq, SamplingParams(max_tokens=4, ignore_eos=True))])[0].sid == "b"
    assert eng.prefix_tokens[1] == (len(seq) - 1) // PS * PS >= 3 * PS  # the prompt and output of "a"
    for mine, theirs in zip(eng.runner.session_kv("b"), fresh.runner.session_kv("b")):
        assert mine.shape[2] == len(seq) and torch.equal(mine, theirs)


def test_tenants_and_re_pointed_versions_do_not_share(bf16_model):
    rng = random.Random(1)
    V = bf16_model.config.vocab_size
    eng = VerifierEngine(bf16_model, kv_capacity_tokens=1 << 12, prefix_caching=True)
    p = random_prompt(rng, V, 3 * PS, 3 * PS)
    _run(eng, {"a": p}, rng, salt={"a": "tenant-1"}, max_tokens=2)
    _run(eng, {"b": p}, rng, salt={"b": "tenant-2"}, max_tokens=2)
    assert eng.prefix_tokens[1] == 0
    _run(eng, {"c": p}, rng, salt={"c": "tenant-1"}, max_tokens=2)
    assert eng.prefix_tokens[1] == 2 * PS
    v1 = Session("x", p, len(p), SamplingParams(), None, frozenset(), adapter="v1", cache_salt="tenant-1")
    before = eng.table.salt(v1)
    eng.drop_versions({"v1"})  # removed or re-pointed: a later "v1" never reads the old one's KV
    assert eng.table.salt(v1) != before
