"""Tensor parallelism on CPU (issue 64): 2 gloo ranks, this test process as rank 0 and one spawned worker.

The engine's own batch-invariance and tree-rejection statistics run unchanged with the engine's runner a 2-rank
:class:`~specdec.model.tp_runner.TPRunner` (their modules' ``VerifierEngine`` is given ``runner=``): greedy output
through edge trees among other sessions equals 2-rank one-token decoding (bf16, fp32); sampled tokens through edge
trees follow the target (chi-square), and fail it when the vocabulary shards are gathered in the wrong order. 2 ranks
against 1 on the embedded target's prompts in fp32; a worker killed mid-generation. docs/tensor_parallel.md."""

from __future__ import annotations

import functools
import os
import random
import signal

import pytest
import torch

import tests.specdec.test_batch_invariance as bi
import tests.specdec.test_engine_tree_rejection as tr
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest, VerifyResult
from specdec.errors import KVStateLost
from specdec.model.checkpoint import tiny_weights
from specdec.model.loading import load_weights, tiny_random_model
from specdec.model.runner import ModelRunner
from specdec.model.shard_plan import check_shardable, kv_heads_of, q_heads_of
from specdec.model.tensor_parallel import FixedOrderGroup, TPDecoderModel
from specdec.model.tp_runner import ShardSpec, TPRunner, TPStartError
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from tests.specdec.test_engine import random_prompt, random_tree

GQA = dict(num_heads=6, num_kv_heads=2, hidden_size=96)  # 3 query heads and 1 KV head per rank
SHARED_KV = dict(num_heads=4, num_kv_heads=1)  # one KV head, replicated on both ranks


def group_of(load, **kw) -> TPRunner:
    return TPRunner(ShardSpec(load, kv_capacity_tokens=kw.pop("kv", 1 << 15), **kw), 2)


@pytest.fixture(scope="module")
def groups():
    """2-rank groups by name, started on first use, stopped at the module's end."""
    made: dict[str, TPRunner] = {}
    loads = {"fp32": functools.partial(tiny_weights, 0, torch.float32),
             "bf16": functools.partial(tiny_weights, 0, torch.bfloat16),
             "gqa-bf16": functools.partial(tiny_weights, 0, torch.bfloat16, **GQA),
             "shared-kv": functools.partial(tiny_weights, 0, torch.float32, **SHARED_KV),
             "stat": functools.partial(tiny_weights, 1, torch.float32)}

    def get(name: str) -> TPRunner:
        if name not in made:
            made[name] = group_of(loads[name], kv=1 << 17 if name == "stat" else 1 << 15)  # stat: 2500 sessions
        runner = made[name]
        for sid in list(runner.pool.sessions):  # what an earlier test's engine left
            runner.drop(sid)
        return runner

    yield get
    for r in made.values():
        r.shutdown()


def with_runner(monkeypatch, module, runner) -> None:
    monkeypatch.setattr(module, "VerifierEngine", functools.partial(VerifierEngine, runner=runner))


# -- the split -------------------------------------------------------------------------------
def test_shard_checks_name_what_does_not_divide():
    smol = dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)
    assert check_shardable(smol, 2) == []  # 3 KV groups: 2 on one rank, 1 on the other
    assert check_shardable(smol, 3) == []
    bad = check_shardable(smol, 4)  # 3 KV heads over 4 ranks: neither split nor replicated evenly
    assert len(bad) == 1 and "9 attention heads / 3 KV heads" in bad[0]
    llama70 = dict(num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672, vocab_size=128256)
    assert check_shardable(llama70, 4) == check_shardable(llama70, 8) == []
    assert check_shardable(llama70, 16) == []  # 8 KV heads replicated twice
    odd = check_shardable(dict(num_attention_heads=8, num_key_value_heads=8, intermediate_size=102,
                               vocab_size=1001), 4)
    assert [m.split()[0] for m in odd] == ["intermediate", "vocabulary"]


def test_heads_follow_their_kv_groups():
    # 64 heads, 8 KV heads, 4 ranks: KV heads 2r, 2r+1 and their 16 query heads
    assert [(kv_heads_of(8, 4, r), q_heads_of(64, 8, 4, r)) for r in (0, 3)] == [
        (range(0, 2), range(0, 16)), (range(6, 8), range(48, 64))]
    # one KV head over 2 ranks: replicated; query heads split
    assert [kv_heads_of(1, 2, r) for r in (0, 1)] == [range(0, 1)] * 2
    assert [q_heads_of(4, 1, 2, r) for r in (0, 1)] == [range(0, 2), range(2, 4)]
    # SmolLM2 over 2 ranks: 1 and 2 KV groups of 3 query heads
    assert [(kv_heads_of(3, 2, r), q_heads_of(9, 3, 2, r)) for r in (0, 1)] == [
        (range(0, 1), range(0, 3)), (range(1, 3), range(3, 9))]


def test_one_rank_shard_is_the_unsharded_model_bit_for_bit():
    """The sharded code path at 1 rank (no collective) gives the unsharded forward's logits exactly."""
    from specdec.model.batch import chunk_input

    for dtype in (torch.float32, torch.bfloat16):
        m = tiny_weights(0, dtype)
        a = ModelRunner(TPDecoderModel(m, FixedOrderGroup.single()), kv_capacity_tokens=1024)
        b = ModelRunner(m, kv_capacity_tokens=1024)
        items = [chunk_input("s", 0, list(range(3, 40)), list(range(37))), chunk_input("t", 0, [9, 8, 7])]
        for x, y in zip(a.forward(0, items), b.forward(0, items)):
            assert torch.equal(x, y)


def test_the_fixed_order_sum_is_the_same_on_every_row_whatever_the_rows(groups):
    """The 2-rank forward of a session's rows gives the same bits alone and among 1..40 other rows."""
    from specdec.model.batch import chunk_input

    runner = groups("bf16")
    rng = random.Random(0)
    alone = runner.forward(0, [chunk_input("s", 0, list(range(3, 23)), list(range(20)))])[0]
    runner.abort(0)
    for bid in range(1, 6):
        others = [chunk_input(f"o{j}", 0, random_prompt(rng, 512, 1, 40)) for j in range(rng.randint(1, 4))]
        items = others + [chunk_input("s", 0, list(range(3, 23)), list(range(20)))]
        rng.shuffle(items)
        out = runner.forward(bid, items)
        assert torch.equal(out[[it.sid for it in items].index("s")], alone)
        runner.abort(bid)


# -- greedy through edge trees = one-token decoding, at 2 ranks -----------------------------------
@pytest.mark.parametrize("name,seed", [("fp32", 0), ("bf16", 1), ("gqa-bf16", 2), ("shared-kv", 3)])
def test_two_rank_greedy_output_is_batch_invariant(groups, monkeypatch, name, seed):
    """:func:`tests.specdec.test_batch_invariance.assert_batch_invariant` with both engines on 2 ranks: 3 prompts'
    greedy output through random trees, random prefill chunks and 1..16 other sessions equals one-token decoding."""
    runner = groups(name)
    with_runner(monkeypatch, bi, runner)
    model = tiny_random_model(seed=0, dtype=runner.dtype, **{"gqa-bf16": GQA, "shared-kv": SHARED_KV}.get(name, {}))
    bi.assert_batch_invariant(model, seed, SamplingParams(max_tokens=32, ignore_eos=True))


# -- 2 ranks against 1 on the embedded target, fp32 ----------------------------------------------
def greedy(engine: VerifierEngine, sid: str, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens, one per round (the prompt prefilled in chunks of 256)."""
    assert engine.begin_open([OpenRequest(sid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))]) == [None]
    while engine.prefilling:
        opened = engine.prefill_step(256)
    out = [opened[0].first_token]
    s = engine.sessions[sid]
    while not s.finished:
        (res,) = engine.verify([VerifyRequest(sid, DraftTree.empty(), len(s.prefix))])
        out += list(res.tokens)
    return out


EMBEDDED_TEXTS = ["Explain why the sky is blue in two sentences.", "Write a haiku about autumn rain.",
                  "List three uses of a paperclip."]


@pytest.mark.slow
def test_two_ranks_against_one_on_the_embedded_prompts_fp32(embedded):
    """SmolLM2-135M (9 heads, 3 KV heads: the ranks hold 1 and 2 KV groups) in fp32, the embedded prompts, 32 greedy
    tokens each. The reductions add the ranks' partial sums in another order than one rank's single dot product,
    so logits differ in the last bits (measured ~1e-5); the tokens must agree, except after a step where the
    1-rank top two are within 1e-3 of each other (then either is a correct argmax). docs/tensor_parallel.md."""
    from tests.specdec.test_engine_embedded import chat_prompt

    tp = group_of(functools.partial(load_weights, "embedded", dtype="float32", device="cpu"))
    try:
        one = VerifierEngine(embedded.model, eos_token_ids=embedded.eos_token_ids)
        two = VerifierEngine(embedded.model, eos_token_ids=embedded.eos_token_ids, runner=tp)
        ref = ModelRunner(embedded.model, kv_capacity_tokens=4096)
        for i, text in enumerate(EMBEDDED_TEXTS):
            prompt = chat_prompt(embedded.tokenizer, text)
            a, b = greedy(one, f"g{i}", prompt, 32), greedy(two, f"g{i}", prompt, 32)
            print(f"embedded prompt {i}: 2 ranks {'equal' if a == b else 'DIFFER'} to 1 rank over {len(a)} tokens")
            if a != b:  # the first divergence must be a near-tie of the 1-rank logits
                k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                from specdec.model.batch import chunk_input

                logits = ref.forward(i, [chunk_input(f"r{i}", 0, prompt + a[:k])])[0][-1]
                ref.abort(i)
                assert abs(float(logits[a[k]] - logits[b[k]])) < 1e-3, (text, k, a, b)
            # the 2-rank logits are within float32 rounding of the 1-rank ones
            from specdec.model.batch import chunk_input

            l1 = ref.forward(100 + i, [chunk_input(f"x{i}", 0, prompt, list(range(len(prompt))))])[0]
            l2 = tp.forward(100 + i, [chunk_input(f"x{i}", 0, prompt, list(range(len(prompt))))])[0]
            ref.abort(100 + i)
            tp.abort(100 + i)
            print(f"embedded prompt {i}: max |logit difference| {float((l1 - l2).abs().max()):.2e}")
            assert float((l1 - l2).abs().max()) < 1e-3
    finally:
        tp.shutdown()


# -- sampled tokens at 2 ranks follow the target (chi-square) -----------------------------------
def test_two_rank_sampled_tokens_follow_the_target(groups, monkeypatch):
    """The tree-rejection statistic (2500 seeded sessions through edge trees, the first two emitted tokens'
    chi-square against the target's marginals, from the unsharded model) with the engine on 2 ranks."""
    with_runner(monkeypatch, tr, groups("stat"))
    pv1, pv2, st = tr.two_tokens(tiny_random_model(seed=1), SamplingParams(temperature=1.0))
    assert pv1 > 1e-3 and pv2 > 1e-3, (pv1, pv2, st)
    assert st["later_sibling"] > 100 and st["deep"] > 50, st


def test_the_statistic_catches_vocabulary_shards_gathered_out_of_order(groups, monkeypatch):
    """Test of the test: rank 0 putting the two vocabulary halves the wrong way round fails it."""
    runner = groups("stat")
    with_runner(monkeypatch, tr, runner)
    right = FixedOrderGroup.gather_cols

    def swapped(self, x):
        full = right(self, x)
        return None if full is None else torch.cat(full.chunk(2, dim=-1)[::-1], dim=-1)

    monkeypatch.setattr(FixedOrderGroup, "gather_cols", swapped)
    pv1, pv2, _ = tr.two_tokens(tiny_random_model(seed=1), SamplingParams(temperature=1.0))
    assert min(pv1, pv2) < 1e-6


# -- a rank killed mid-generation ---------------------------------------------------------------
def test_a_killed_rank_restarts_the_group_and_the_session_finishes_identically(groups, monkeypatch):
    """The worker is SIGKILLed after a few rounds of a greedy session among others: the next round raises
    KVStateLost naming every session (the engine has closed them), the group is running again, and the session,
    re-opened from its history as an edge does, finishes with the undisturbed run's tokens."""
    runner = groups("bf16")
    model = tiny_random_model(seed=0, dtype=torch.bfloat16)
    rng = random.Random(7)
    prompt = random_prompt(rng, 512, 5, 60)
    n = 40
    with_runner(monkeypatch, bi, runner)
    truth = bi.one_token_decode(model, (), prompt, SamplingParams(max_tokens=n, ignore_eos=True))

    eng = VerifierEngine(model, runner=runner, limits=bi.LIMITS)
    others = {f"o{i}": random_prompt(rng, 512, 1, 80) for i in range(4)}
    eng.open([OpenRequest(sid, p, SamplingParams(max_tokens=1000, ignore_eos=True)) for sid, p in others.items()])
    (first,) = eng.open([OpenRequest("s", prompt, SamplingParams(max_tokens=n, ignore_eos=True))])
    out, rounds, killed = [first.first_token], 0, False
    while len(out) < n:
        if rounds == 3 and not killed:
            (pid,) = runner.launcher.pids()
            os.kill(pid, signal.SIGKILL)
            killed = True
        s = eng.sessions["s"]
        reqs = [VerifyRequest("s", random_tree(rng, truth[len(out):], 512, max_size=12, max_depth=5), len(s.prefix))]
        reqs += [VerifyRequest(o, DraftTree.empty(), len(eng.sessions[o].prefix)) for o in others if o in eng.sessions]
        try:
            res = eng.verify(reqs)
        except KVStateLost as e:
            assert killed and "s" in e.sessions and set(others) <= set(e.sessions)
            assert not eng.sessions and not runner.pool.sessions
            # the edge re-opens from its history: the prompt and every token it has
            (re,) = eng.open([OpenRequest("s", prompt + out, SamplingParams(max_tokens=n - len(out),
                                                                                 ignore_eos=True))])
            out.append(re.first_token)
            others = {}
            continue
        assert isinstance(res[0], VerifyResult), res[0]
        out += list(res[0].tokens)
        rounds += 1
    assert killed and runner.restarts == 1
    assert out == truth


def _loads_on_rank_0_only(pid: int):
    if os.getpid() != pid:
        raise ValueError("no such checkpoint")
    return tiny_weights(0, torch.float32)


def test_a_worker_that_cannot_load_is_one_clear_error_and_nothing_stays_up():
    with pytest.raises(TPStartError, match="rank 1: ValueError: no such checkpoint") as e:
        group_of(functools.partial(_loads_on_rank_0_only, os.getpid()))
    assert "did not start" in str(e.value)


def test_a_config_that_does_not_split_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="intermediate size 129 is not divisible"):
        TPDecoderModel(tiny_weights(0, torch.float32, intermediate_size=129), FixedOrderGroup(None, None, 0, 2))


def test_a_rank_reads_only_its_part_of_a_checkpoint_and_gets_the_same_shard(tmp_path):
    """read_weights(shard=(rank, tp)) reads each tensor's rows or columns of that rank only (safetensors slices);
    the shard built from it is the one sliced from the whole model, tensor for tensor (SmolLM2's uneven split)."""
    from specdec.model.checkpoint import read_weights
    from specdec.model.loading import safetensors_dir

    path = safetensors_dir("embedded")
    whole = read_weights(path, torch.float32)
    for rank in (0, 1):
        part = read_weights(path, torch.float32, shard=(rank, 2))
        assert part.config.num_key_value_heads == (1, 2)[rank] and part.config.full_config.vocab_size == 49152
        a = TPDecoderModel(part, FixedOrderGroup(None, None, rank, 2))
        b = TPDecoderModel(whole, FixedOrderGroup(None, None, rank, 2))
        assert a.spec == b.spec and a.config.vocab_size == 49152
        for x, y in zip(a.layer_linears() + [a.lm_head], b.layer_linears() + [b.lm_head]):
            assert torch.equal(x.weight, y.weight)
        assert torch.equal(a.embed, b.embed)
        held = sum(t.numel() for t in part.parameters())
        assert held < 0.6 * sum(t.numel() for t in whole.parameters())


class _NoRestart:
    """A launcher whose workers start once: the second start fails as a worker that cannot load would."""

    def __init__(self):
        from specdec.model.tp_runner import ProcessLauncher

        self.inner, self.starts = ProcessLauncher(), 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, addr, port, world, spec):
        self.starts += 1
        if self.starts > 1:
            raise RuntimeError("no device left for rank 1")
        self.inner.start(addr, port, world, spec)


def test_a_group_that_cannot_start_again_is_down_and_says_why():
    from specdec.model.batch import chunk_input

    runner = TPRunner(ShardSpec(functools.partial(tiny_weights, 0, torch.float32), kv_capacity_tokens=1024,
                                timeout_s=20), 2, _NoRestart())
    try:
        runner.forward(0, [chunk_input("s", 0, [3, 4, 5])])
        os.kill(runner.launcher.pids()[0], signal.SIGKILL)
        with pytest.raises(TPStartError, match="no device left for rank 1"):
            runner.forward(1, [chunk_input("t", 0, [3, 4, 5])])
        assert "no device left" in runner.broken
        with pytest.raises(RuntimeError, match="tensor-parallel group is down"):
            runner.forward(2, [chunk_input("u", 0, [3])])
    finally:
        runner.shutdown()


def test_workers_leave_when_rank_0_is_gone():
    """Rank 0 gone (its group closed without a stop command, as when the replica's process dies): the worker's next
    collective fails and it exits on its own; nothing stays running."""
    runner = group_of(functools.partial(tiny_weights, 0, torch.float32), kv=1024)
    (proc,) = runner.launcher.procs
    runner.group.close()
    proc.join(timeout=20)
    assert proc.exitcode == 3  # serve_rank's exit on a lost group
    runner.launcher.stop()


def test_a_launch_whose_worker_never_started_stops_cleanly():
    """A worker whose ``start`` raised was never started: stopping the launch joins only the started ones, so the
    start's own error is what the caller sees (not multiprocessing's 'can only join a started process')."""
    import multiprocessing as mp

    from specdec.model.tp_runner import ProcessLauncher

    launcher = ProcessLauncher()
    launcher.procs = [mp.get_context("spawn").Process(target=print)]
    launcher.stop()
    assert launcher.procs == [] and launcher.failed() is None
