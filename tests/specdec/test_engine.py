"""The verification engine on a tiny random Llama (fp32): lossless greedy and sampled output,
batching, invalid requests (chain mode: test_chain_verify.py; opens and re-opens: test_prefill.py).

Ground truth is :func:`reference_decode` (target-only decoding through the model's own HF
forward) and, independently, ``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import InvalidRequest, InvalidTree, PrefixMismatch, SessionFinished, SessionNotFound, SpecError
from specdec import engine as engine_module
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest, VerifyResult
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.model.batch import tree_input
from specdec.sampling import SamplingParams, target_probs
from specdec.tree import DraftTree, TreeLimits
from tests.specdec.test_acceptance import wrong_top2
from tests.specdec.test_sampling import chi_square_pvalue

EOS = 2
LOGIT_TOL = 1e-3  # fp32: tree forwards vs one-token forwards, far below typical top-2 gaps


# -- helpers shared with the embedded-model tests ----------------------------------------
def random_tree(rng: random.Random, truth: list[int], vocab: int, max_size: int = 64, max_depth: int = 12,
                allow_empty: bool = True, min_size: int | None = None) -> DraftTree:
    """A random tree (size <= max_size, depth <= a random cap <= max_depth) that usually holds a
    prefix of ``truth`` (the target's own continuation) along one random path, among random branches."""
    size = rng.randint(min_size if min_size is not None else (0 if allow_empty else 1), max_size)
    cap = rng.randint(1, max_depth)
    parents: list[int] = []
    depths: list[int] = []
    for i in range(size):
        cands = [-1] + [j for j in range(i) if depths[j] < cap]
        p = cands[-1] if rng.random() < 0.5 else rng.choice(cands)  # mix deep chains and bushy levels
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
    tokens = [rng.randrange(vocab) for _ in range(size)]
    if size and truth and rng.random() < 0.85:
        node, path = rng.randrange(size), []
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        for j, n in enumerate(path[: rng.randint(1, len(path))]):
            if j < len(truth):
                tokens[n] = truth[j]
    return DraftTree(tuple(tokens), tuple(parents))


def expected_walk(tree: DraftTree, rem: list[int]) -> tuple[int, ...]:
    """Accepted nodes when the target emits ``rem`` (first matching child; the last token is a bonus)."""
    acc: list[int] = []
    pos = 0
    while len(acc) < len(rem) - 1:
        nxt = next((c for c in tree.children[pos] if tree.tokens[c] == rem[len(acc)]), None)
        if nxt is None:
            break
        acc.append(nxt)
        pos = nxt + 1
    return tuple(acc)


def drive(engine: VerifierEngine, truths: dict[str, list[int]], rng: random.Random, *, max_size: int = 64,
          max_depth: int = 12, check_rounds: bool = True, max_rounds: int | None = None,
          truncate: bool = False) -> int:
    """Verify rounds with random trees in random batch compositions until every session ends
    (or after ``max_rounds`` calls). ``truncate``: each request verifies only a random prefix
    of its tree (server-side truncation).

    ``truths[sid]`` is the target-only output of the session; each round's accepted nodes and
    tokens are checked against it (``check_rounds``). Returns the number of verify calls.
    """
    calls = 0
    while calls < (max_rounds or 10_000):
        live = [sid for sid in truths if sid in engine.sessions and not engine.sessions[sid].finished]
        if not live:
            return calls
        batch = rng.sample(live, rng.randint(1, len(live)))
        reqs, rems = [], []
        for sid in batch:
            s = engine.sessions[sid]
            rem = truths[sid][s.num_generated:]
            tree = random_tree(rng, rem, engine.vocab_size, max_size, max_depth)
            reqs.append(VerifyRequest(sid, tree, len(s.prefix), rng.randint(0, len(tree)) if truncate else None))
            rems.append(rem)
        results = engine.verify(reqs)
        calls += 1
        for req, rem, res in zip(reqs, rems, results):
            assert isinstance(res, VerifyResult), res
            if check_rounds:
                acc = expected_walk(req.tree if req.limit is None else req.tree.prefix(req.limit), rem)
                assert res.accepted == acc, (req, rem, res)
                assert list(res.tokens) == rem[: len(acc) + 1]
                assert res.bonus == rem[len(acc)]
            assert res.prefix_len == len(engine.sessions[req.sid].prefix)
            assert res.finished == engine.sessions[req.sid].finished
    if max_rounds is None:
        raise AssertionError("sessions did not finish")
    return calls


def generated(engine: VerifierEngine, sid: str) -> list[int]:
    s = engine.sessions[sid]
    return s.prefix[s.prompt_len:]


def single_token_logits(model, prefix: list[int], tree: DraftTree) -> torch.Tensor:
    """[n + 1, V]: logits at the root and every node, decoding ONE token per forward (HF cache),
    depth-first with cache cropping. Independent of the engine's runner."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        if len(prefix) > 1:
            model(input_ids=torch.tensor([prefix[:-1]]), past_key_values=cache, use_cache=True)
        base = len(prefix) - 1
        rows: list[torch.Tensor | None] = [None] * (len(tree) + 1)
        rows[0] = model(input_ids=torch.tensor([[prefix[-1]]]), past_key_values=cache).logits[0, -1].float()

        def visit(parent: int) -> None:  # parent: -1 = root
            for c in tree.children[parent + 1]:
                keep = base + tree.depths[c]  # prefix[:-1] + root + ancestors of c
                if cache.get_seq_length() > keep:
                    cache.crop(keep - cache.get_seq_length())
                rows[c + 1] = model(input_ids=torch.tensor([[tree.tokens[c]]]),
                                    past_key_values=cache).logits[0, -1].float()
                visit(c)

        visit(-1)
    return torch.stack(rows)  # type: ignore[arg-type]


def tree_forward_logits(engine: VerifierEngine, sids_trees: list[tuple[str, DraftTree]]) -> list[torch.Tensor]:
    """The engine runner's logits (float32) for trees of several sessions in ONE packed forward (no commit)."""
    items = [tree_input(sid, len(engine.sessions[sid].prefix) - 1, engine.sessions[sid].prefix[-1], t.tokens,
                        t.parents, t.depths) for sid, t in sids_trees]
    out = engine.runner.forward(-1, items)
    engine.runner.abort(-1)
    return [x.float() for x in out]


def compare_logits(multi: torch.Tensor, single: torch.Tensor, tol: float = LOGIT_TOL) -> dict:
    """Assert tree-forward and one-token-forward logits agree far below the argmax gaps."""
    diff = float((multi - single).abs().max())
    top2 = torch.topk(single, 2, dim=-1).values  # [n + 1, 2]
    gaps = top2[:, 0] - top2[:, 1]
    assert diff < tol, f"max |logit diff| {diff:.2e} >= {tol}"
    clear = gaps > 2 * diff  # argmax cannot flip where the gap exceeds twice the difference
    assert torch.equal(multi.argmax(-1)[clear], single.argmax(-1)[clear])
    return {"max_diff": diff, "min_gap": float(gaps.min()), "median_gap": float(gaps.median()),
            "near_ties": int((~clear).sum())}


# -- fixtures --------------------------------------------------------------------------
@pytest.fixture
def engine(tiny_model):
    return VerifierEngine(tiny_model, eos_token_ids=(EOS,))


def random_prompt(rng: random.Random, vocab: int, lo: int = 1, hi: int = 40) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]


# -- 1. greedy losslessness ------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_greedy_verification_equals_target_only_decoding(tiny_model, seed):
    """1..8 sessions of different prefix lengths; random trees (1..64 nodes, depth 1..12) with the
    true continuation partially inside; random batch compositions; sessions opened mid-run."""
    rng = random.Random(seed)
    V = tiny_model.config.vocab_size
    forwards = []
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,), on_forward=forwards.append)
    n = rng.randint(1, 8)
    specs = {}
    for i in range(n):
        prompt = random_prompt(rng, V)
        params = SamplingParams(max_tokens=rng.randint(1, 40))
        if rng.random() < 0.4:  # a stop id the target really emits, to end sessions mid-stream
            free = reference_decode(tiny_model, prompt, params, (EOS,))
            params = SamplingParams(max_tokens=params.max_tokens, stop_token_ids=(free[len(free) // 2],))
        specs[f"s{i}"] = (prompt, params, reference_decode(tiny_model, prompt, params, (EOS,)))
    sids = list(specs)
    first, later = sids[: max(1, n // 2)], sids[max(1, n // 2):]
    for group in (first, later):
        if not group:
            continue
        res = eng.open([OpenRequest(sid, specs[sid][0], specs[sid][1]) for sid in group])
        for sid, r in zip(group, res):
            assert r.first_token == specs[sid][2][0]
        drive(eng, {sid: specs[sid][2] for sid in first}, rng, max_rounds=3)  # interleave: some rounds first
    calls = drive(eng, {sid: specs[sid][2] for sid in sids}, rng, truncate=seed % 2 == 1)
    for sid in sids:
        assert generated(eng, sid) == specs[sid][2], sid
        assert eng.runner.kv_length(sid) == 0  # finished: KV released
    verify_forwards = [f for f in forwards if f.kind == "verify"]
    assert all(f.sessions >= 1 for f in verify_forwards) and len(verify_forwards) >= calls


def test_one_forward_per_verify_call_for_all_sessions(tiny_model):
    forwards = []
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,), on_forward=forwards.append)
    rng = random.Random(7)
    sids = [f"s{i}" for i in range(8)]
    eng.open([OpenRequest(sid, random_prompt(rng, 512), SamplingParams(max_tokens=20)) for sid in sids])
    assert [f.kind for f in forwards] == ["prefill"] and forwards[0].sessions == 8
    trees = [random_tree(rng, [], 512, allow_empty=False) for _ in sids]
    eng.verify([VerifyRequest(sid, t, len(eng.sessions[sid].prefix)) for sid, t in zip(sids, trees)])
    assert len(forwards) == 2 and forwards[1].kind == "verify" and forwards[1].sessions == 8
    assert forwards[1].tokens == sum(len(t) + 1 for t in trees)  # packed: no padding
    # each forward's own CPU time (the forward thread's clock; the wall time includes any preemption)
    assert all(0 < f.cpu_seconds <= f.seconds + 0.01 for f in forwards)


def test_tree_forward_agrees_with_one_token_forwards(tiny_model, engine):
    """fp32: the batched, packed tree forward and one-token HF decoding differ far below argmax gaps."""
    rng = random.Random(3)
    sids = ["a", "b", "c"]
    engine.open([OpenRequest(sid, random_prompt(rng, 512, 5, 60), SamplingParams(max_tokens=50)) for sid in sids])
    trees = [random_tree(rng, [], 512, 64, 12, allow_empty=False) for _ in sids]
    multi = tree_forward_logits(engine, list(zip(sids, trees)))
    for sid, tree, m in zip(sids, trees, multi):
        stats = compare_logits(m, single_token_logits(tiny_model, engine.sessions[sid].prefix, tree))
        assert stats["max_diff"] < 1e-4  # tiny model: rounding only


# -- 2. independent reference ------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_greedy_verification_equals_hf_generate(tiny_model, seed):
    rng = random.Random(100 + seed)
    prompts = {f"g{i}": random_prompt(rng, 512, 2, 30) for i in range(3)}
    want = {}
    for sid, prompt in prompts.items():
        out = tiny_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  do_sample=False, max_new_tokens=24, min_new_tokens=0, eos_token_id=EOS,
                                  pad_token_id=0)
        want[sid] = out[0, len(prompt):].tolist()
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    eng.open([OpenRequest(sid, p, SamplingParams(max_tokens=24)) for sid, p in prompts.items()])
    drive(eng, want, rng)
    for sid in prompts:
        assert generated(eng, sid) == want[sid]


# -- 3. sampling ---------------------------------------------------------------------------
def test_seeded_sampling_equals_reference_sample_path(tiny_model):
    """One uniform per emitted token: with the same seed, verification reproduces reference_decode."""
    rng = random.Random(11)
    variants = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9),
                SamplingParams(temperature=1.2, top_k=20), SamplingParams(temperature=0.7, top_k=40, top_p=0.95)]
    specs = {}
    for i in range(8):
        base = variants[i % len(variants)]
        params = SamplingParams(temperature=base.temperature, top_k=base.top_k, top_p=base.top_p,
                                seed=1000 + i, max_tokens=30)
        prompt = random_prompt(rng, 512)
        specs[f"r{i}"] = (prompt, params, reference_decode(tiny_model, prompt, params, (EOS,)))
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    eng.open([OpenRequest(sid, p, prm) for sid, (p, prm, _) in specs.items()])
    drive(eng, {sid: v[2] for sid, v in specs.items()}, rng, check_rounds=False)
    same = sum(generated(eng, sid) == specs[sid][2] for sid in specs)
    # only a uniform within float rounding of a CDF boundary could differ
    assert same >= len(specs) - 1, same
    # and trees were really accepted along the way (not bonus-only decoding)
    assert any(len(v[2]) > 1 for v in specs.values())


V_STAT = 8  # small vocabulary: the joint of two tokens has 64 cells


@pytest.fixture(scope="module")
def model_small():
    return tiny_random_model(seed=1, vocab_size=V_STAT)


STAT_PROMPT = [3, 5, 7, 1]
STAT_ROOT = 4
STAT_SESSIONS = 1500


def exact_two_token_joint(model, params: SamplingParams) -> dict[tuple[int, int], float]:
    """The target's distribution of its next two tokens after STAT_PROMPT + [STAT_ROOT]."""
    ctx = STAT_PROMPT + [STAT_ROOT]
    with torch.inference_mode():
        p1 = target_probs(model(torch.tensor([ctx])).logits[0, -1], params)  # [V]
        seqs = torch.tensor([ctx + [x] for x in range(V_STAT)])
        p2 = target_probs(model(seqs).logits[:, -1], params)  # [V, V]
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(V_STAT) for b in range(V_STAT)}


def stat_tree(model) -> DraftTree:
    """Fixed draft tree policy: the target's top-3 at the root (plus a low-rank token), the top-2
    under the first two, one grandchild."""
    ctx = STAT_PROMPT + [STAT_ROOT]
    with torch.inference_mode():
        top = torch.topk(model(torch.tensor([ctx])).logits[0, -1], V_STAT).indices.tolist()
        a, b, c = top[:3]
        aa, ab = torch.topk(model(torch.tensor([ctx + [a]])).logits[0, -1], 2).indices.tolist()
        ba, bb = torch.topk(model(torch.tensor([ctx + [b]])).logits[0, -1], 2).indices.tolist()
        aaa = int(torch.argmax(model(torch.tensor([ctx + [a, aa]])).logits[0, -1]))
    return DraftTree((a, b, c, top[-1], aa, ab, ba, bb, aaa), (-1, -1, -1, -1, 0, 0, 1, 1, 4))


def sample_two_tokens_via_engine(model, params: SamplingParams, truncate: bool = False) -> list[tuple[int, int]]:
    """STAT_SESSIONS seeded sessions share a prefix; verification rounds (all sessions in one
    forward each) until every session emitted two tokens. ``truncate``: each session's first
    tree is verified only up to a random prefix (server-side truncation)."""
    eng = VerifierEngine(model, eos_token_ids=())
    sids = [f"x{i}" for i in range(STAT_SESSIONS)]
    opened = eng.open([OpenRequest(sid, STAT_PROMPT, SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=i, max_tokens=8),
        generated=(STAT_ROOT,)) for i, sid in enumerate(sids)])
    assert all(r.first_token is None for r in opened)
    tree = stat_tree(model)
    cut = random.Random(7)
    reqs = [VerifyRequest(sid, tree, len(STAT_PROMPT) + 1, cut.randint(0, len(tree)) if truncate else None)
            for sid in sids]
    while reqs:
        eng.verify(reqs)
        # later rounds: a fixed small tree (any policy is lossless); stop once two tokens exist
        reqs = [VerifyRequest(sid, DraftTree((1, 2), (-1, -1)), len(eng.sessions[sid].prefix))
                for sid in sids if eng.sessions[sid].num_generated < 3]
    return [tuple(generated(eng, sid)[1:3]) for sid in sids]


def counts_of(samples) -> dict:
    out: dict = {}
    for s in samples:
        out[s] = out.get(s, 0) + 1
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["T1", "T0.7-k5-p0.9"])
def test_tree_verification_samples_the_target_distribution(model_small, params):
    samples = sample_two_tokens_via_engine(model_small, params)
    joint = exact_two_token_joint(model_small, params)
    assert chi_square_pvalue(counts_of(samples), joint) > 1e-3


def test_truncated_trees_sample_the_target_distribution(model_small):
    """Issue 15: any prefix of a priority-ordered tree is verified exactly."""
    params = SamplingParams(temperature=1.0)
    samples = sample_two_tokens_via_engine(model_small, params, truncate=True)
    assert chi_square_pvalue(counts_of(samples), exact_two_token_joint(model_small, params)) > 1e-3


def test_engine_statistic_catches_a_wrong_acceptance_rule(model_small, monkeypatch):
    """Test of the test: the engine with a 'child in the target's top-2' rule fails the statistic."""
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(engine_module, "walk_tree", wrong_top2)
    samples = sample_two_tokens_via_engine(model_small, params)
    assert chi_square_pvalue(counts_of(samples), exact_two_token_joint(model_small, params)) < 1e-6


# -- 4. batching ------------------------------------------------------------------------------
def test_batched_verification_equals_verifying_each_alone(tiny_model):
    rng = random.Random(21)
    specs = {}
    for i in range(6):
        params = SamplingParams(max_tokens=25) if i % 2 else SamplingParams(temperature=0.9, seed=i, max_tokens=25)
        specs[f"b{i}"] = (random_prompt(rng, 512, 1, 50), params)
    together = VerifierEngine(tiny_model, eos_token_ids=(EOS,))
    alone = {sid: VerifierEngine(tiny_model, eos_token_ids=(EOS,)) for sid in specs}
    r_tog = together.open([OpenRequest(sid, p, prm) for sid, (p, prm) in specs.items()])
    for sid, r in zip(specs, r_tog):
        assert alone[sid].open([OpenRequest(sid, *specs[sid])])[0] == r
    while any(not s.finished for s in together.sessions.values()):
        live = [sid for sid, s in together.sessions.items() if not s.finished]
        reqs = [VerifyRequest(sid, random_tree(rng, [], 512, 40, 8), len(together.sessions[sid].prefix))
                for sid in live]
        # tree logits: one packed forward for all vs one forward each
        multi = tree_forward_logits(together, [(r.sid, r.tree) for r in reqs])
        for r, m in zip(reqs, multi):
            single = tree_forward_logits(alone[r.sid], [(r.sid, r.tree)])[0]
            assert (m - single).abs().max() < 1e-4
        res_tog = together.verify(reqs)
        for r, rt in zip(reqs, res_tog):
            assert alone[r.sid].verify([r])[0] == rt
    for sid in specs:
        assert generated(together, sid) == generated(alone[sid], sid)
        assert reference_decode(tiny_model, *specs[sid], (EOS,)) == generated(together, sid)


# -- 6. invalid requests leave sessions intact ---------------------------------------------
def snapshot(eng: VerifierEngine, sid: str):
    s = eng.sessions[sid]
    return (list(s.prefix), s.finished, eng.runner.kv_length(sid),
            None if s.generator is None else s.generator.get_state().clone())


def assert_intact(eng, sid, snap):
    now = snapshot(eng, sid)
    assert now[:3] == snap[:3]
    assert (now[3] is None and snap[3] is None) or now[3].equal(snap[3])


def test_invalid_trees_are_typed_errors_and_leave_sessions_intact(tiny_model):
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,), limits=TreeLimits(max_nodes=16, max_depth=6))
    rng = random.Random(9)
    specs = {"ok": (random_prompt(rng, 512), SamplingParams(max_tokens=30)),
             "smp": (random_prompt(rng, 512), SamplingParams(temperature=1.0, seed=3, max_tokens=30))}
    want = {sid: reference_decode(tiny_model, p, prm, (EOS,)) for sid, (p, prm) in specs.items()}
    eng.open([OpenRequest(sid, p, prm) for sid, (p, prm) in specs.items()])
    drive(eng, want, rng, max_size=16, max_depth=6, max_rounds=2)
    V = 512
    for sid in specs:
        L = len(eng.sessions[sid].prefix)
        bad = [
            (DraftTree((5, 6), (-1, 1)), L, InvalidTree),  # parent not earlier than the child
            (DraftTree((5, 6), (-1, 7)), L, InvalidTree),
            (DraftTree((5, V), (-1, 0)), L, InvalidTree),  # token outside the vocabulary
            (DraftTree((5, -3), (-1, 0)), L, InvalidTree),
            (DraftTree((5,), (-1, -1)), L, InvalidTree),  # parents / tokens lengths differ
            (DraftTree((5,) * 17, (-1,) * 17), L, InvalidTree),  # size over the limit
            (DraftTree.chain([5] * 7), L, InvalidTree),  # depth over the limit
            (DraftTree((5,), (-1,)), L - 1, PrefixMismatch),  # wrong prefix length
            (DraftTree((5,), (-1,)), L + 3, PrefixMismatch),
        ]
        for tree, plen, err in bad:
            snap = snapshot(eng, sid)
            # the bad request shares the batch with a valid request of the other session
            other = next(o for o in specs if o != sid)
            o_s = eng.sessions[other]
            o_snap = None if o_s.finished else len(o_s.prefix)
            reqs = [VerifyRequest(sid, tree, plen)]
            if o_snap is not None:
                reqs.append(VerifyRequest(other, DraftTree.empty(), len(o_s.prefix)))
            res = eng.verify(reqs)
            assert isinstance(res[0], err) and isinstance(res[0], SpecError), res[0]
            assert 400 <= res[0].status < 500 and res[0].to_dict()["error"]["code"] == res[0].code
            if isinstance(res[0], PrefixMismatch):
                assert res[0].status == 409 and res[0].details["server_prefix_len"] == L
            assert_intact(eng, sid, snap)
            if o_snap is not None:  # the valid neighbour was verified normally
                assert isinstance(res[1], VerifyResult) and res[1].tokens == tuple(want[other][o_snap - len(
                    specs[other][0]): o_snap - len(specs[other][0]) + 1])
    # duplicate session in one batch: the second is refused, the first verified
    sid = "ok"
    if not eng.sessions[sid].finished:
        L = len(eng.sessions[sid].prefix)
        res = eng.verify([VerifyRequest(sid, DraftTree.empty(), L), VerifyRequest(sid, DraftTree.empty(), L)])
        assert isinstance(res[0], VerifyResult) and isinstance(res[1], InvalidRequest)
    # unknown session
    res = eng.verify([VerifyRequest("nope", DraftTree.empty(), 3)])
    assert isinstance(res[0], SessionNotFound) and res[0].status == 404
    # the sessions still produce exactly the reference
    drive(eng, want, rng, max_size=16, max_depth=6)
    for sid in specs:
        assert generated(eng, sid) == want[sid]
    # finished session
    res = eng.verify([VerifyRequest("ok", DraftTree.empty(), len(eng.sessions["ok"].prefix))])
    assert isinstance(res[0], SessionFinished) and res[0].status == 409


def test_a_tree_past_the_model_context_is_clipped_and_ends_with_length(tiny_model):
    """Issue 14: a tree crossing max_model_len got a 400 (fatal to the agent); it is cut to
    the nodes that fit and the generation ends with "length", exactly the reference's tokens."""
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,), max_model_len=40)
    prompt = list(range(3, 33))
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    truth = reference_decode(tiny_model, prompt, SamplingParams(max_tokens=9, ignore_eos=True)) + [0] * 6
    eng.open([OpenRequest("a", prompt, params)])
    s = eng.sessions["a"]
    # prefix 31: the root sits at position 30, a depth-9 node at 39 (the last that fits)
    # a wrong chain first (nodes 0-11), then the right one (nodes 12-23): both 12 deep
    wrong = [(t + 1) % 512 for t in truth[1:13]]
    chain = tuple(range(-1, 11))
    tree = DraftTree(tuple(wrong) + tuple(truth[1:13]), chain + tuple(p + 12 if p >= 0 else -1 for p in chain))
    res = eng.verify([VerifyRequest("a", tree, len(prompt) + 1)])[0]
    assert isinstance(res, VerifyResult) and res.finished and res.finish_reason == "length"
    # the reply names the edge's own node indices (the right chain's, under the depth cut)
    assert res.accepted == tuple(range(12, 12 + len(res.accepted))) and len(res.accepted) == 7
    assert [s.prefix[len(prompt)]] + list(res.tokens) == truth[: len(s.prefix) - len(prompt)]
    assert len(s.prefix) == 39 and eng.kv_tokens() == 0  # finished: its KV is released


def test_a_failed_kv_commit_drops_only_that_batchs_sessions(tiny_model):
    """Issue 14: a pipeline stage's failed commit left its KV out of step and surfaced in the
    next, unrelated batch. Now the batch that failed names its sessions (dropped, to be
    re-opened) and a session outside it goes on exactly."""
    from specdec.errors import KVStateLost
    from specdec.model.runner import ModelRunner

    class FlakyRunner(ModelRunner):
        fail_next = False

        def commit(self, batch_id, keep):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("stage 1 died")
            super().commit(batch_id, keep)

    runner = FlakyRunner(tiny_model)
    eng = VerifierEngine(tiny_model, eos_token_ids=(EOS,), runner=runner)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng.open([OpenRequest("a", [5, 6, 7], params), OpenRequest("b", [8, 9, 10], params)])
    runner.fail_next = True
    with pytest.raises(KVStateLost) as e:
        eng.verify([VerifyRequest("a", DraftTree.chain([5, 6]), 4)])
    assert e.value.sessions == ("a",) and "a" not in eng.sessions and runner.kv_length("a") == 0
    while not eng.sessions["b"].finished:
        eng.verify([VerifyRequest("b", DraftTree.empty(), len(eng.sessions["b"].prefix))])
    assert eng.sessions["b"].prefix[3:] == reference_decode(tiny_model, [8, 9, 10], params)
