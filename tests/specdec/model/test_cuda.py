"""The same engine on CUDA (skipped without a GPU): the forward, pool and the Triton kernels run
on the device; fp32 greedy output equals target-only decoding; bf16 greedy output does not
depend on batch composition, tree shape or padding (specdec/model/cuda); each kernel agrees
with the torch reference and gives a row the same bits in any batch."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.model.attention import torch_attention, tree_attention
from specdec.model.batch import ancestor_bits, signed64
from specdec.engine import OpenRequest, VerifierEngine
from specdec.model.loading import EMBEDDED_SHAPES, tiny_random_model
from specdec.model.native import PAGE_SIZE
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from tests.specdec.test_engine import drive, random_prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_greedy_verification_on_cuda_equals_target_only_decoding():
    cpu = tiny_random_model(seed=1)
    gpu = tiny_random_model(seed=1).to("cuda")
    rng = random.Random(0)
    specs = {f"g{i}": (random_prompt(rng, 512, 3, 60), SamplingParams(max_tokens=30, ignore_eos=True))
             for i in range(4)}
    truths = {sid: reference_decode(cpu, p, prm) for sid, (p, prm) in specs.items()}
    eng = VerifierEngine(gpu)
    assert eng.runner.pool.k.device.type == "cuda" and eng.runner.model.kernel  # the Triton kernel
    res = eng.open([OpenRequest(sid, p, prm) for sid, (p, prm) in specs.items()])
    assert [r.first_token for r in res] == [truths[sid][0] for sid in specs]
    drive(eng, truths, rng, check_rounds=True)
    for sid in specs:
        s = eng.sessions[sid]
        assert s.prefix[s.prompt_len:] == truths[sid]
    assert eng.runner.model.graphs.captures > 0  # the forwards replayed CUDA graphs


def test_cuda_bf16_runs_trees_and_releases_the_pool():
    model = tiny_random_model(seed=2, dtype=torch.bfloat16).to("cuda")
    rng = random.Random(1)
    eng = VerifierEngine(model)
    eng.open([OpenRequest(f"b{i}", random_prompt(rng, 512, 3, 40), SamplingParams(max_tokens=12, ignore_eos=True))
              for i in range(3)])
    truths = {sid: [] for sid in eng.sessions}
    drive(eng, truths, rng, check_rounds=False)
    assert all(s.finished for s in eng.sessions.values())
    assert eng.runner.pool.pages_in_use == 0


def test_cuda_lora_versions_mixed_in_one_batch_equal_their_merged_models(tmp_path):
    """Sessions of the base and two LoRA versions in every batch on the device: the row groups
    index the model's tensors with device indices (a CPU index tensor raises there)."""
    pytest.importorskip("peft")
    from tests.specdec.model.test_lora import ALL, decode_mixed, engine_with, make_adapter, merged

    cpu = tiny_random_model(seed=3)
    paths = {"all": make_adapter(cpu, tmp_path / "all", 1, ALL),
             "qv": make_adapter(cpu, tmp_path / "qv", 2, ["q_proj", "v_proj"], r=8)}
    refs = {None: cpu, **{v: merged(cpu, p) for v, p in paths.items()}}
    rng = random.Random(5)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    sessions = {f"{v}-{i}": (v, random_prompt(rng, 512, 3, 50)) for v in refs for i in range(2)}
    truths = {sid: reference_decode(refs[v], p, params) for sid, (v, p) in sessions.items()}
    eng = engine_with(tiny_random_model(seed=3).to("cuda"), paths)
    forwards = []
    eng.on_forward = forwards.append
    assert decode_mixed(eng, sessions, params, truths, rng) == truths
    assert forwards[0].sessions == len(sessions)  # the versions shared a forward
    assert all(p.A.weight.device.type == "cuda" for ad in eng.adapters.loaded.values()
               for pairs in ad.layers.values() for p in pairs.values())


def test_triton_attention_matches_the_torch_reference():
    from tests.specdec.model.test_attention import D, Hq, _pages, _plan

    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        k, v = (t.cuda() for t in _pages(12, dtype))
        bits = [signed64(b) for b in ancestor_bits([-1, -1, 0, 2, 1, 3])]
        plan = _plan([[0, 1, 2, 3], [7, 5, 9]], [(0, 40, 0)] + [(0, 40, b) for b in bits] + [(1, 1, 0), (1, 33, 0)])
        q = torch.randn(len(bits) + 3, Hq, D).to(dtype).cuda()
        a = tree_attention(q, k, v, plan.to("cuda"), D ** -0.5, kernel=True)
        b = torch_attention(q, k, v, plan.to("cuda"), D ** -0.5)
        assert (a.float() - b.float()).abs().max() < tol


@pytest.mark.parametrize("seed", range(12))
def test_triton_attention_gives_a_tree_row_the_bits_of_the_same_sequence_decoded_contiguously(seed):
    """Row j of a tree (prefix + ancestors, scattered over pages, batched with other rows) is
    bit-identical to one row over the same keys laid out contiguously on other pages."""
    from tests.specdec.model.test_attention import D, Hq, _pages, _plan

    rng = random.Random(seed)
    prefix = rng.randint(1, 200)
    parents = [rng.randint(-1, j - 1) if j else -1 for j in range(rng.randint(1, 40))]
    n = len(parents)
    k, v = _pages(40, torch.bfloat16, seed)
    bits = ancestor_bits(parents)
    tree_pages = rng.sample(range(20), -(-(prefix + n) // PAGE_SIZE))
    other = [rng.randrange(20) for _ in range(3)]
    rows = [(0, prefix, signed64(b)) for b in bits] + [(1, rng.randint(1, 40), 0) for _ in range(rng.randint(1, 9))]
    rng.shuffle(rows)
    q = torch.randn(len(rows), Hq, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    out = tree_attention(q.cuda(), k.cuda(), v.cuda(), _plan([tree_pages, other], rows).to("cuda"), D ** -0.5,
                         kernel=True).cpu()
    for r, (sess, _len, b) in enumerate(rows):
        if sess != 0:
            continue
        seq = list(range(prefix)) + [prefix + j for j in range(n) if (b >> j) & 1]
        k2, v2 = k.clone(), v.clone()
        for i, p in enumerate(seq):
            sp, so = tree_pages[p // PAGE_SIZE], p % PAGE_SIZE
            k2[20 + i // PAGE_SIZE, :, :, i % PAGE_SIZE], v2[20 + i // PAGE_SIZE, :, i % PAGE_SIZE, :] = \
                k[sp, :, :, so], v[sp, :, so, :]
        alone = tree_attention(q[r: r + 1].cuda(), k2.cuda(), v2.cuda(),
                               _plan([list(range(20, 40))], [(0, len(seq), 0)]).to("cuda"), D ** -0.5, kernel=True)
        assert torch.equal(alone[0].cpu(), out[r])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_norms_and_linears_give_a_row_the_same_bits_in_any_batch(dtype):
    """RMSNorm (Triton) and the linears (fixed-row GEMMs), at the embedded model's shapes: each
    row of a batch of M equals the row computed alone, for M across several GEMM chunks."""
    from specdec.model.glue import make_glue, residual_norm
    from specdec.model.linear import Linear

    g = torch.Generator().manual_seed(0)
    glue = make_glue(torch.device("cuda"), dtype)
    w_norm = torch.randn(576, generator=g).to(dtype).cuda()
    linears = [Linear(torch.randn(n, k, generator=g).div(k ** 0.5).to(dtype).cuda()) for n, k in
               [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]]
    for M in (1, 2, 3, 7, 16, 64, 127, 128, 129, 300):
        h = torch.randn(M, 576, generator=g).to(dtype).cuda()
        delta = torch.randn(M, 576, generator=g).to(dtype).cuda()
        h_out, x = glue.residual_norm(h, delta, w_norm, 1e-5)
        ref_h, ref_x = residual_norm(h, delta, w_norm, 1e-5)
        assert torch.equal(h_out, ref_h) and (x.float() - ref_x.float()).abs().max() < 0.1
        for r in {0, M // 2, M - 1}:
            assert torch.equal(glue.residual_norm(h[r: r + 1], delta[r: r + 1], w_norm, 1e-5)[1][0], x[r])
        for lin in linears:
            K = lin.in_features
            a = torch.randn(M, K, generator=g).to(dtype).cuda()
            y = lin(a)
            assert (y.float() - torch.nn.functional.linear(a, lin.weight).float()).abs().max() < 0.1
            for r in {0, M // 2, M - 1}:
                assert torch.equal(lin(a[r: r + 1])[0], y[r])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_rope_write_and_swiglu_match_the_torch_glue_and_give_a_row_the_same_bits_alone(dtype):
    """The fused Triton RoPE + K/V write and SwiGLU against the torch glue (K/V written to the
    same slots, values equal up to one rounding), and each row alone equal to the row in its batch."""
    from specdec.model.glue import Glue, make_glue
    from specdec.model.kv_pool import KVPool

    N, hq, hkv, d = 37, 9, 3, 64
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(N, hq + 2 * hkv, d, generator=g).to(dtype).cuda()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.randint(0, 4000, (N,), generator=g).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype)[:, None].cuda(), emb.sin().to(dtype)[:, None].cuda()
    where = KVPool.locate(torch.randperm(300, generator=g)[:N].cuda())
    pools = [KVPool(2, hkv, d, 320, dtype, torch.device("cuda")) for _ in range(3)]
    for pool in pools:
        pool.k.zero_()
        pool.v.zero_()
    ours = make_glue(torch.device("cuda"), dtype)
    q_ref = Glue().rope_write(qkv, cos, sin, hq, hkv, None, None, 1e-5, pools[0], 1, where)
    q = ours.rope_write(qkv, cos, sin, hq, hkv, None, None, 1e-5, pools[1], 1, where)
    tol = 0.05 if dtype == torch.bfloat16 else 1e-5
    assert (q.float() - q_ref.float()).abs().max() < tol
    assert (pools[1].k.float() - pools[0].k.float()).abs().max() < tol and torch.equal(pools[1].v, pools[0].v)
    for r in (0, N // 2, N - 1):
        alone = ours.rope_write(qkv[r: r + 1], cos[r: r + 1], sin[r: r + 1], hq, hkv, None, None, 1e-5, pools[2], 1,
                                (where[0][r: r + 1], where[1][r: r + 1]))
        assert torch.equal(alone[0], q[r])
        page, off = where[0][r], where[1][r]
        assert torch.equal(pools[2].k[1][page, :, :, off], pools[1].k[1][page, :, :, off])
    gate_up = torch.randn(N, 2 * 1536, generator=g).to(dtype).cuda()
    y = ours.swiglu(gate_up)
    assert (y.float() - Glue().swiglu(gate_up).float()).abs().max() < tol * 4
    assert all(torch.equal(ours.swiglu(gate_up[r: r + 1])[0], y[r]) for r in (0, N // 2, N - 1))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cfg", [dict(), dict(num_heads=6, num_kv_heads=2, hidden_size=96),
                                 {**EMBEDDED_SHAPES, "num_layers": 4}])
def test_cuda_bf16_greedy_output_is_batch_invariant(seed, cfg):
    """The CPU test (test_batch_invariance.py) on the device, also at the embedded model's
    widths (4 of its 30 layers): random trees, random prefill chunking, 1..16 other sessions."""
    from tests.specdec.test_batch_invariance import assert_batch_invariant

    assert_batch_invariant(tiny_random_model(seed=seed, dtype=torch.bfloat16, **cfg).to("cuda"), seed,
                           SamplingParams(max_tokens=40, ignore_eos=True))


def _at_embedded_widths(seed: int):
    """A bf16 random model at the embedded model's widths (4 of its 30 layers), on the device."""
    return tiny_random_model(seed=seed, dtype=torch.bfloat16, **{**EMBEDDED_SHAPES, "num_layers": 4}).to("cuda")


def test_cuda_bf16_seeded_sampled_output_is_batch_invariant():
    """Sampling on the device (softmax, top-p over [V] rows of CUDA logits): seeded output equals
    one-token decoding's in any batch (the CPU test of test_batch_invariance.py)."""
    from tests.specdec.test_batch_invariance import SAMPLED, assert_batch_invariant

    assert_batch_invariant(_at_embedded_widths(12), 12, SamplingParams(seed=19, **SAMPLED))


def test_cuda_bf16_greedy_output_is_batch_invariant_without_graphs(monkeypatch):
    """test_cuda_bf16_greedy_output_is_batch_invariant replays CUDA graphs (the default); here
    every forward launches its kernels: that path is invariant too."""
    from specdec.model.cuda.graphs import LayerGraphs
    from tests.specdec.test_batch_invariance import assert_batch_invariant

    monkeypatch.setattr(LayerGraphs, "__call__", lambda self, batch, pool, hidden: None)
    assert_batch_invariant(_at_embedded_widths(11), 11, SamplingParams(max_tokens=30, ignore_eos=True))


@pytest.mark.parametrize("cfg", [dict(), {**EMBEDDED_SHAPES, "num_layers": 4}])
def test_cuda_graph_replays_give_the_eager_forwards_bits(cfg):
    """The same forwards (prefill chunks up to 1100 rows, decode roots, trees of up to 40 nodes, 1-6
    sessions) through a runner replaying graphs and one launching every kernel: bit-equal logits;
    the graphs ran (several shapes; an 1100-row chunk, past the largest bucket, eagerly)."""
    from specdec.model.batch import chunk_input, tree_input
    from specdec.model.runner import ModelRunner
    from tests.specdec.model.test_cuda_graphs import _random_tree

    model = tiny_random_model(seed=7, dtype=torch.bfloat16, **cfg).to("cuda")
    graphed, eager = (ModelRunner(model, kv_capacity_tokens=1 << 14) for _ in range(2))
    eager.model.graphs = None
    V = model.config.vocab_size
    rng = random.Random(7)
    for step in range(40):
        items = []
        for i in rng.sample(range(6), rng.randint(1, 6)):
            sid, L = f"s{i}", graphed.kv_length(f"s{i}")
            assert L == eager.kv_length(sid)
            if L == 0:
                n = 1100 if i == 5 else rng.randint(1, 150)
                items.append(chunk_input(sid, 0, [rng.randrange(V) for _ in range(n)]))
            else:
                toks, parents, depths = _random_tree(rng, rng.choice([0, 0, rng.randint(1, 40)]), V)
                items.append(tree_input(sid, L, rng.randrange(V), toks, parents, depths))
        keep = {it.sid: (len(it.tokens) if it.positions == it.write_at else 1, []) for it in items}
        outs = []
        for r in (graphed, eager):
            outs.append(r.forward(step, items))
            r.commit(step, keep)
        assert all(torch.equal(a, b) for a, b in zip(*outs)), f"step {step}"
    graphs = graphed.model.graphs
    assert graphs.captures >= 4
    assert graphed.pool.pages_in_use == eager.pool.pages_in_use  # the scratch page is no session's


@pytest.mark.parametrize("mode", ["stop-and-wait", "proactive"])
def test_an_edge_agent_drafting_on_cuda_against_the_engine_on_cuda_equals_target_only_decoding(mode):
    """A consumer-GPU edge: the draft model's forwards (the same runner, CUDA graphs included) on
    the device, verified by the engine on the device (float32), in-process."""
    import asyncio

    from edge_agent.agent import AgentConfig, EdgeAgent
    from edge_agent.draft_backends import ModelDrafter
    from edge_agent.transport import LocalTransport
    from tests.edge_agent.helpers import noisy_copy

    cpu = tiny_random_model(seed=4)
    prompt, params = [1, 5, 9, 33, 7, 100, 200], SamplingParams(max_tokens=40, ignore_eos=True)
    truth = reference_decode(cpu, prompt, params)
    drafter = ModelDrafter(noisy_copy(cpu, 0.005).to("cuda"))
    agent = EdgeAgent(LocalTransport(VerifierEngine(tiny_random_model(seed=4).to("cuda"))), drafter,
                      config=AgentConfig(mode=mode))
    try:
        res = asyncio.run(agent.generate(prompt, params))
    finally:
        agent.close()
    assert res.token_ids == truth
    assert res.stats.accepted_tokens > 0 and drafter.runner.model.graphs.captures > 0


@pytest.mark.parametrize("seed", range(2))
def test_cuda_bf16_greedy_output_is_batch_invariant_across_attention_chunks(seed):
    """A Llama-3-8B head layout (GQA groups of 4, head dim 128; 2 layers): prompts of 470-560
    tokens, so sessions decode across the attention's first chunk boundary (cuda.plan.CHUNK) with
    trees and other sessions beside them: output equals one-token decoding, token for token."""
    from specdec.model.cuda.plan import CHUNK
    from tests.specdec.test_batch_invariance import batched_decode, one_token_decode

    model = tiny_random_model(seed=seed, dtype=torch.bfloat16, num_heads=8, num_kv_heads=2, hidden_size=1024,
                              intermediate_size=512, num_layers=2).to("cuda")
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompts = {f"p{i}": random_prompt(rng, model.config.vocab_size, CHUNK - 42, CHUNK + 48) for i in range(3)}
    truths = {sid: one_token_decode(model, (), p, params) for sid, p in prompts.items()}
    assert batched_decode(model, (), prompts, params, truths, rng) == truths
