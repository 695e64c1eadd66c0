"""LoRA target versions in the forward (specdec/model/lora.py) and their multiplexing
(deploy/verifier/adapters.py): sessions of the base and of several versions verified in one
batch equal each version's own decoding (the adapter merged into the HF model by PEFT), fp32
token for token; bf16 rows independent of their batch and of the other rows' versions."""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import pytest
import torch

from specdec.errors import ModelNotFound, UnsupportedModel, VersionUnavailable
from deploy.verifier.adapters import AdapterRegistry
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest, VerifyResult
from specdec.model.lora import WEIGHTS_FILE, AdapterConfig, check
from specdec.model.linear import Linear
from specdec.model.loading import tiny_random_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeLimits
from tests.specdec.test_engine import random_prompt, random_tree

peft = pytest.importorskip("peft")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LIMITS = TreeLimits(max_nodes=64, max_depth=16)


def make_adapter(base, path, seed: int, targets, r: int = 4, alpha: float = 8.0, **extra) -> str:
    """A random PEFT LoRA adapter (A and B both random, unlike a fresh fine-tune) saved by PEFT."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                        init_lora_weights=False, **extra))
    pm.save_pretrained(str(path))
    return str(path)


def merged(base, path):
    """The version as a plain HF model: the adapter merged into the weights by PEFT."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), path).merge_and_unload().eval()


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """A tiny fp32 base and two versions: every linear (r=4), and q/v only with rsLoRA (r=8)."""
    base = tiny_random_model(seed=3)
    d = tmp_path_factory.mktemp("lora")
    paths = {"all": make_adapter(base, d / "all", 1, ALL),
             "qv": make_adapter(base, d / "qv", 2, ["q_proj", "v_proj"], r=8, alpha=4, use_rslora=True)}
    return base, paths


def engine_with(model, paths, max_loaded=4):
    dm_engine = VerifierEngine(model, limits=LIMITS)
    dm_engine.adapters = AdapterRegistry(dm_engine.runner.model, paths, max_loaded)
    return dm_engine


def decode_mixed(eng, sessions: dict[str, tuple[str | None, list[int]]], params, truths, rng) -> dict:
    """Every session in every batch (random trees around each one's own truth)."""
    V = eng.vocab_size
    opened = eng.open([OpenRequest(sid, p, params, adapter=v) for sid, (v, p) in sessions.items()])
    out = {r.sid: [r.first_token] for r in opened}
    while any(not eng.sessions[sid].finished for sid in sessions):
        live = [sid for sid in sessions if not eng.sessions[sid].finished]
        reqs = []
        for sid in live:
            s = eng.sessions[sid]
            tree = random_tree(rng, truths[sid][s.num_generated:], V, max_size=24, max_depth=8)
            reqs.append(VerifyRequest(sid, tree, len(s.prefix)))
        for req, res in zip(reqs, eng.verify(reqs)):
            assert isinstance(res, VerifyResult), res
            out[req.sid] += list(res.tokens)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_fp32_greedy_of_every_version_in_one_batch_equals_its_merged_model(versions, seed):
    base, paths = versions
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    refs = {None: base, **{v: merged(base, p) for v, p in paths.items()}}
    sessions = {f"{v}-{i}": (v, random_prompt(rng, 512, 1, 60)) for v in refs for i in range(2)}
    truths = {sid: reference_decode(refs[v], p, params) for sid, (v, p) in sessions.items()}
    eng = engine_with(base, paths)
    forwards = []
    eng.on_forward = forwards.append
    got = decode_mixed(eng, sessions, params, truths, rng)
    assert got == truths
    assert all(f.sessions == len(sessions) for f in forwards[:2])  # all versions really shared the batches
    # the versions really differ (a forward that ignored the adapters would fail above)
    p = sessions["all-0"][1]
    assert len({tuple(reference_decode(m, p, params)) for m in refs.values()}) == 3


def test_bf16_rows_are_independent_of_their_batch_and_the_other_versions(tmp_path):
    """Each session alone, one token per forward, vs all versions mixed with random trees and
    random other sessions (base and versions) in every batch: identical in bf16."""
    base32 = tiny_random_model(seed=4, num_heads=6, num_kv_heads=2, hidden_size=96)
    paths = {"all": make_adapter(base32, tmp_path / "all", 5, ALL),
             "mlp": make_adapter(base32, tmp_path / "mlp", 6, ["gate_proj", "up_proj", "down_proj"], r=2)}
    model = copy.deepcopy(base32).to(torch.bfloat16)
    rng = random.Random(4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    sessions = {f"{v}-{i}": (v, random_prompt(rng, 512, 1, 80)) for v in (None, "all", "mlp") for i in range(2)}
    truths = {sid: one_token(engine_with(model, paths), p, params, v) for sid, (v, p) in sessions.items()}
    assert len({tuple(t) for t in truths.values()}) == len(truths)
    eng = engine_with(model, paths, max_loaded=1)  # and every batch loads/evicts versions
    others = {f"o{i}": (rng.choice([None, "all", "mlp"]), random_prompt(rng, 512, 1, 100)) for i in range(6)}
    got = decode_among_others(eng, sessions, others, params, truths, rng, max_size=32)
    assert got == truths
    assert eng.adapters.evictions > 0 and len(eng.adapters.held()) <= 2


def one_token(eng: VerifierEngine, prompt: list[int], params, version) -> list[int]:
    """The session alone, one token per forward (prefill included); closed afterwards."""
    assert eng.begin_open([OpenRequest("ref", prompt, params, adapter=version)]) == [None]
    while eng.prefilling:
        opened = eng.prefill_step(1)
    out, s = [opened[0].first_token], eng.sessions["ref"]
    while not s.finished:
        (res,) = eng.verify([VerifyRequest("ref", DraftTree.empty(), len(s.prefix))])
        out += list(res.tokens)
    eng.close("ref")
    return out


def decode_among_others(eng, sessions: dict, others: dict, params, truths: dict, rng, max_size: int) -> dict:
    """Open ``sessions`` and ``others`` (sid -> (version, prompt); the others never finish) in a shuffled order,
    prefill them in random chunks, then verify random trees along each session's ``truths`` in random batches
    mixed with others, until every session finishes; each session's tokens (sid -> ids)."""
    reqs = [OpenRequest(sid, p, SamplingParams(max_tokens=1 << 10, ignore_eos=True), adapter=v)
            for sid, (v, p) in others.items()] + [OpenRequest(sid, p, params, adapter=v)
                                                   for sid, (v, p) in sessions.items()]
    rng.shuffle(reqs)
    assert all(e is None for e in eng.begin_open(reqs))
    got: dict[str, list[int]] = {}
    while eng.prefilling:
        for res in eng.prefill_step(rng.randint(1, 64)):
            got[res.sid] = [res.first_token]
    while any(not eng.sessions[sid].finished for sid in sessions):
        live = [sid for sid in sessions if not eng.sessions[sid].finished]
        batch = rng.sample(live, rng.randint(1, len(live))) + rng.sample(sorted(others), rng.randint(1, len(others)))
        reqs = [VerifyRequest(sid, random_tree(rng, truths.get(sid, [])[eng.sessions[sid].num_generated:], 512,
                                               max_size=max_size, max_depth=8), len(eng.sessions[sid].prefix))
                for sid in batch]
        for req, res in zip(reqs, eng.verify(reqs)):
            assert isinstance(res, VerifyResult), res
            if req.sid in sessions:
                got[req.sid] += list(res.tokens)
    return {sid: got[sid] for sid in sessions}


@pytest.mark.parametrize("K,N,r", [(576, 8, 8), (8, 576, 8), (1536, 24, 24), (24, 1728, 24), (576, 16, 16)])
def test_lora_matmuls_give_the_same_bf16_rows_for_every_row_count(K, N, r):
    """The LoRA factors' shapes (small r) go through Linear, whose rows do not depend on M."""
    g = torch.Generator().manual_seed(K + N)
    lin = Linear(torch.randn(N, K, generator=g).to(torch.bfloat16))
    x = torch.randn(64, K, generator=g).to(torch.bfloat16)
    full = lin(x)
    for m in (1, 2, 3, 7, 16, 33, 64):
        assert torch.equal(lin(x[:m]), full[:m]), m


def test_registry_loads_on_first_use_evicts_lru_and_forgets_removed_versions(versions):
    base, paths = versions
    eng = engine_with(base, paths, max_loaded=1)
    reg = eng.adapters
    assert reg.held() == [] and reg.loads == 0  # nothing loaded before a forward needs it
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng.open([OpenRequest("a", [5, 6, 7], params, adapter="all")])
    assert reg.held() == ["all"] and reg.loads == 1
    eng.open([OpenRequest("q", [5, 6, 7], params, adapter="qv")])
    assert reg.held() == ["qv"] and reg.evictions == 1
    eng.open([OpenRequest("b", [5, 6, 7], params)])  # the base loads nothing
    assert reg.held() == ["qv"]
    (err,) = eng.begin_open([OpenRequest("x", [5], params, adapter="nope")])
    assert isinstance(err, ModelNotFound) and err.status == 404 and "nope" in err.message
    # removing a version: its sessions end, 404 from then on; the others carry on
    gone = reg.update({"qv": paths["qv"]}, 1)
    assert gone == {"all"} and eng.drop_versions(gone) == ["a"]
    res = eng.verify([VerifyRequest(sid, DraftTree.empty(), len(eng.sessions[sid].prefix)) for sid in ("q", "b")])
    assert all(isinstance(r, VerifyResult) for r in res)
    (err,) = eng.begin_open([OpenRequest("a2", [5], params, adapter="all")])
    assert isinstance(err, ModelNotFound)


def test_unsupported_adapters_are_refused_with_the_reason(versions, tmp_path):
    base, paths = versions
    bad = make_adapter(base, tmp_path / "embed", 1, ["q_proj", "embed_tokens"])
    with pytest.raises(UnsupportedModel, match="target_modules"):
        AdapterConfig.read(bad)
    saved = make_adapter(base, tmp_path / "save", 1, ["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(UnsupportedModel, match="modules_to_save"):
        AdapterConfig.read(saved)
    with pytest.raises(UnsupportedModel, match="adapter_config.json"):
        AdapterConfig.read(tmp_path)
    other = tiny_random_model(seed=0, hidden_size=96, num_heads=6, num_kv_heads=2)
    wrong = make_adapter(other, tmp_path / "wrong", 1, ["q_proj"])
    dm = VerifierEngine(base).runner.model
    with pytest.raises(UnsupportedModel, match="shape"):
        check(wrong, dm.spec, dm.config.intermediate_size)


def corrupt(path: str, silently: bool = False) -> None:
    """Zero the header of an adapter's safetensors file in place (no longer readable);
    ``silently``: size and mtime kept, as a disk corruption would (the fingerprint still matches)."""
    f = Path(path) / WEIGHTS_FILE
    st = f.stat()
    data = f.read_bytes()
    f.write_bytes(b"\x00" * 16 + data[16:])
    if silently:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_bad_versions_are_refused_when_declared_and_the_others_serve_exactly(versions, tmp_path):
    """A corrupt safetensors file and an adapter shaped for another base, declared beside a good
    version: both are unavailable from the declaration on (503 with the reason); sessions of the
    base and the good version in the same batches decode exactly."""
    base, paths = versions
    broken = make_adapter(base, tmp_path / "broken", 7, ALL)
    corrupt(broken)
    other = tiny_random_model(seed=0, hidden_size=96, num_heads=6, num_kv_heads=2)
    wrong = make_adapter(other, tmp_path / "wrong", 8, ["q_proj", "down_proj"])
    eng = engine_with(base, {"all": paths["all"], "broken": broken, "wrong": wrong}, max_loaded=1)
    reg = eng.adapters
    assert sorted(reg.unavailable) == ["broken", "wrong"] and reg.served() == ["all"]
    assert "cannot be read" in reg.unavailable["broken"] and "shape" in reg.unavailable["wrong"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    rng = random.Random(7)
    sessions = {f"{v}-{i}": (v, random_prompt(rng, 512, 1, 40)) for v in (None, "all") for i in range(2)}
    refs = {None: base, "all": merged(base, paths["all"])}
    truths = {sid: reference_decode(refs[v], p, params) for sid, (v, p) in sessions.items()}
    errs = eng.begin_open([OpenRequest("b", [5, 6], params, adapter="broken"),
                           OpenRequest("w", [5, 6], params, adapter="wrong")])
    assert all(isinstance(e, VersionUnavailable) and e.status == 503 and e.code == "model_unavailable" for e in errs)
    assert "cannot be read" in errs[0].message and "shape" in errs[1].message
    assert decode_mixed(eng, sessions, params, truths, rng) == truths
    assert reg.loads == 1 and reg.held() == ["all"]


def test_a_load_failure_fails_only_that_versions_sessions(versions, tmp_path):
    """A version whose file goes bad after it was declared (rewritten in place, evicted, then
    needed again): the load in the middle of a batch fails its sessions only (503, closed, also
    the one being prefilled); the base's and another version's sessions of the same batches go
    on exactly; a config update with good weights serves the version again."""
    import shutil

    base, paths = versions
    qv = shutil.copytree(paths["qv"], tmp_path / "qv")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    rng = random.Random(9)
    sessions = {f"{v}-{i}": (v, random_prompt(rng, 512, 1, 40)) for v in (None, "all", "qv") for i in range(2)}
    refs = {None: base, "all": merged(base, paths["all"]), "qv": merged(base, str(qv))}
    truths = {sid: reference_decode(refs[v], p, params) for sid, (v, p) in sessions.items()}
    eng = engine_with(base, {"all": paths["all"], "qv": str(qv)}, max_loaded=1)
    opened = eng.open([OpenRequest(sid, p, params, adapter=v) for sid, (v, p) in sessions.items()])
    got = {r.sid: [r.first_token] for r in opened}
    assert eng.adapters.held() == ["qv"] or eng.adapters.held() == ["all"]
    eng.adapters._evict(keep={"all"})  # qv evicted: the next batch reloads it
    eng.adapters.loaded.pop("qv", None)
    corrupt(str(qv), silently=True)
    assert eng.begin_open([OpenRequest("qv-late", [9, 8, 7], params, adapter="qv")]) == [None]
    reqs = [VerifyRequest(sid, DraftTree.empty(), len(eng.sessions[sid].prefix)) for sid in sessions]
    res = eng.verify(reqs, prefill_tokens=8)  # the late open's chunk rides along
    for req, r in zip(reqs, res):
        if sessions[req.sid][0] == "qv":
            assert isinstance(r, VersionUnavailable) and r.status == 503 and "cannot be read" in r.message, r
            assert req.sid not in eng.sessions
        else:
            assert isinstance(r, VerifyResult), r
            got[req.sid] += list(r.tokens)
    failed = eng.take_version_failures()
    assert sorted(failed) == ["qv-0", "qv-1", "qv-late"] and "qv-late" not in eng.prefilling
    assert all(isinstance(e, VersionUnavailable) for e in failed.values())
    (err,) = eng.begin_open([OpenRequest("qv-again", [5], params, adapter="qv")])
    assert isinstance(err, VersionUnavailable)
    live = {sid: sessions[sid] for sid in sessions if sessions[sid][0] != "qv"}
    while any(not eng.sessions[sid].finished for sid in live):
        reqs = [VerifyRequest(sid, random_tree(rng, truths[sid][eng.sessions[sid].num_generated:], 512,
                                               max_size=16, max_depth=6), len(eng.sessions[sid].prefix))
                for sid in live if not eng.sessions[sid].finished]
        for req, r in zip(reqs, eng.verify(reqs)):
            got[req.sid] += list(r.tokens)
    assert {sid: got[sid] for sid in live} == {sid: truths[sid] for sid in live}
    # the file restored and re-declared (a new fingerprint): served again
    shutil.copy(Path(paths["qv"]) / WEIGHTS_FILE, qv / WEIGHTS_FILE)
    assert eng.adapters.update({"all": paths["all"], "qv": str(qv)}, 1) == {"qv"}
    (r,) = eng.open([OpenRequest("qv-back", sessions["qv-0"][1], params, adapter="qv")])
    assert r.first_token == truths["qv-0"][0]


def test_a_version_rewritten_in_place_counts_as_changed(versions, tmp_path):
    """Same name, same path, new bytes: the update ends its sessions and the next load reads
    the new weights; a load that finds other bytes than were declared refuses them."""
    import shutil

    base, paths = versions
    v = shutil.copytree(paths["all"], tmp_path / "v")
    eng = engine_with(base, {"v": str(v)}, max_loaded=1)
    reg = eng.adapters
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.open([OpenRequest("s", [5, 6, 7], params, adapter="v")])
    assert reg.update({"v": str(v)}, 1) == set()  # unchanged
    make_adapter(base, v, 33, ALL)  # rewritten in place
    reg.loaded.clear()
    assert "v" in eng.adapters.activate({"v"})  # other bytes than declared: not served to old sessions
    assert "changed on disk" in reg.unavailable["v"]
    assert reg.update({"v": str(v)}, 1) == {"v"} and eng.drop_versions({"v"}) == ["s"]
    assert reg.unavailable == {} and reg.activate({"v"}) == {}
    (r,) = eng.open([OpenRequest("t", [5, 6, 7], params, adapter="v")])
    assert r.first_token == reference_decode(merged(base, str(v)), [5, 6, 7], params)[0]
