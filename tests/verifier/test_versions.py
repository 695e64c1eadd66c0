"""Target versions on a replica (deploy/verifier/versions.py, the VerifierServer batch loop, no
Serve): edge agents of the base and two LoRA versions share one replica holding at most one
adapter; each version's output equals its own (PEFT-merged) decoding, versions share forwards,
adapters load and evict; removing a version answers 404 to its sessions only; each version,
and within it each draft class, paces by its own acceptance."""

from __future__ import annotations

import asyncio

import pytest

from deploy.config import AppConfig
from specdec.errors import ModelNotFound
from deploy.verifier.server import VerifierServer
from specdec.model.loading import load_model
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig, EdgeAgent
from edge_agent.draft_backends import ModelDrafter
from edge_agent.replica_transport import ReplicaTransport
from tests.edge_agent.helpers import noisy_copy
from tests.specdec.model.test_lora import ALL, make_adapter, merged

pytest.importorskip("peft")
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7, 100, 200, 33, 7], [4, 8, 15, 16, 23, 42], [300, 301, 302, 7, 7, 9, 11]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("versions")
    loaded = load_model("tiny-random", dtype="float32", seed=0)
    paths = {"code": make_adapter(loaded.model, d / "code", 11, ALL),
             "chat": make_adapter(loaded.model, d / "chat", 12, ["q_proj", "v_proj", "down_proj"], r=8)}
    refs = {None: loaded.model, **{v: merged(loaded.model, p) for v, p in paths.items()}}
    return loaded, paths, refs


def make_core(loaded, paths, **target):
    cfg = AppConfig(target={"model": "tiny-random", "dtype": "float32", "adapters": paths,
                            "max_loaded_adapters": 1, **target},
                    verifier={"batch_wait_ms": 5.0, "max_tree_nodes": 32})
    return VerifierServer(cfg, loaded=loaded)


async def run_agents(core, jobs, draft):
    """One agent per (version, prompt), all at once on the one replica."""
    agents = [EdgeAgent(ReplicaTransport(core), ModelDrafter(draft), config=AgentConfig(model=v, budget=8))
              for v, _ in jobs]
    try:
        return await asyncio.gather(*[a.generate(p, GREEDY) for a, (_, p) in zip(agents, jobs)])
    finally:
        for a in agents:
            a.close()


def test_versions_share_forwards_on_one_replica_holding_one_adapter(setup):
    loaded, paths, refs = setup
    core = make_core(loaded, paths)
    seen = []  # the versions each forward needed
    activate = core.versions.registry.activate
    core.versions.registry.activate = lambda names: (seen.append(set(names)), activate(names))[1]
    draft = noisy_copy(loaded.model, scale=0.01)
    jobs = [(v, p) for v in (None, "code", "chat") for p in PROMPTS[:2]]
    results = asyncio.run(run_agents(core, jobs, draft))
    for (v, p), res in zip(jobs, results):
        assert res.token_ids == reference_decode(refs[v], p, GREEDY), v
    assert len({tuple(r.token_ids) for r in results}) == len(results)
    assert any(len(s) == 2 for s in seen)  # two versions in one forward
    reg = core.versions.registry
    assert reg.loads >= 2 and reg.evictions >= 1 and len(reg.held()) <= 1  # trimmed back after each forward
    st = core.stats()
    assert st["tokens_emitted"] >= sum(len(r.token_ids) for r in results)
    # the forwards' own CPU time, by kind, never more than their wall time (GET /v1/stats; benchmarks split on it)
    assert st["busy_cpu_seconds"]["verify"] > 0 and st["busy_cpu_seconds"]["prefill"] > 0
    assert sum(st["busy_cpu_seconds"].values()) <= st["busy_seconds"] + 0.05
    # the points the forward cost curve is fitted on, by row count: (rows, mean seconds, weight)
    pts = st["forward_cost_points"]
    assert pts and all(x >= 1 and t > 0 and n >= 1 for x, t, n in pts)
    assert [x for x, _, _ in pts] == sorted({x for x, _, _ in pts})


def test_removed_version_answers_404_and_the_others_go_on(setup):
    loaded, paths, refs = setup

    async def scenario():
        core = make_core(loaded, paths)
        opened = {}
        for v in ("code", "chat", None):
            status, payload = await core.open_session("dev", {"prompt_ids": PROMPTS[0], "model": v,
                                                              "sampling": GREEDY.to_dict()})
            assert status == 200 and payload["model"] == (v or loaded.name), payload
            opened[v] = payload
        out = await core.update_versions({"code": paths["code"]}, 1)
        assert out == {"versions": ["code"], "removed": ["chat"], "closed_sessions": 1, "unavailable": {}}
        from specdec.protocol import VerifyFrame

        status, err = await core.verify(opened["chat"]["session_id"], "dev",
                                        VerifyFrame(opened["chat"]["prefix_len"], [], []).encode())
        assert status == 404 and err["error"]["code"] == "model_not_found", err
        status, err = await core.open_session("dev", {"prompt_ids": PROMPTS[0], "model": "chat"})
        assert status == 404 and err["error"]["code"] == "model_not_found"
        for v in ("code", None):  # untouched: they decode on, exactly
            s = opened[v]
            status, reply = await core.verify(s["session_id"], "dev", VerifyFrame(s["prefix_len"], [], []).encode())
            assert status == 200
        # and a version added back by a config update serves again
        await core.update_versions(paths, 1)
        status, payload = await core.open_session("dev", {"prompt_ids": PROMPTS[1], "model": "chat"})
        assert status == 200

    asyncio.run(scenario())


def test_each_version_paces_by_its_own_acceptance(setup):
    loaded, paths, _ = setup
    core = make_core(loaded, paths)
    v = core.versions
    core.engine.sessions.clear()
    from specdec.engine import Session

    for sid, ver in (("s-base", None), ("s-code", "code")):
        core.engine.sessions[sid] = Session(sid, [1, 2], 2, GREEDY, None, frozenset(), adapter=ver)
    for _ in range(20):  # the base accepts a lot, "code" nothing beyond the bonus token
        v.pacer("s-base").observe_round(32, 9)
        v.pacer("s-code").observe_round(32, 1)
    for rows in range(1, 200, 7):  # a forward-cost curve that makes rows cost
        v.base_pacer.observe_forward(rows, 0.01 + 0.001 * rows)
    assert v.pacer("s-code") is not v.base_pacer and v.pacer("s-code").cost is v.base_pacer.cost
    assert v.pacer("s-code").budget_hint(8) < v.pacer("s-base").budget_hint(8)
    shared = make_core(loaded, paths).versions
    shared.per_version = False
    shared.engine.sessions["s-code"] = Session("s-code", [1, 2], 2, GREEDY, None, frozenset(), adapter="code")
    assert shared.pacer("s-code") is shared.base_pacer
    with pytest.raises(ModelNotFound):
        v.resolve("nope")
    assert v.resolve("base") is None and v.resolve(loaded.name) is None and v.resolve("code") == "code"


def test_each_draft_class_paces_by_its_own_acceptance(setup):
    """A replica serves several kinds of client: sessions naming a draft class at open keep that
    class's acceptance (per version), up to pacing.max_draft_classes classes; the rest share
    the version's estimates. In a full benchmark run the client kinds' 4-node trees brought 1.46-2.51
    tokens a round; one shared estimate held whichever kind had run last."""
    loaded, paths, _ = setup
    from deploy.verifier.server import VerifierServer
    from specdec.engine import Session

    core = VerifierServer(AppConfig(target={"model": "tiny-random", "dtype": "float32", "adapters": paths},
                                  pacing={"max_draft_classes": 2}), loaded=loaded)
    v = core.versions
    core.engine.sessions.clear()
    for sid, ver in (("a", None), ("b", None), ("c", None), ("code-a", "code")):
        core.engine.sessions[sid] = Session(sid, [1, 2], 2, GREEDY, None, frozenset(), adapter=ver)
    for _ in range(20):  # class "deep" accepts a lot, "shallow" nothing beyond the bonus token
        v.pacer("a", "deep").observe_round(32, 9)
        v.pacer("b", "shallow").observe_round(32, 1)
    for rows in range(1, 200, 7):
        v.base_pacer.observe_forward(rows, 0.01 + 0.001 * rows)
    deep, shallow = v.pacer("a", "deep"), v.pacer("b", "shallow")
    assert deep is not shallow and deep is not v.base_pacer and deep.cost is shallow.cost is v.base_pacer.cost
    assert shallow.budget_hint(8) < deep.budget_hint(8)
    assert v.pacer("b", "deep") is deep  # a class, not a session
    assert v.pacer("c", "third") is v.base_pacer  # two classes taken: the version's shared estimates
    code_deep = v.pacer("code-a", "deep")  # per version, then per class
    assert code_deep is not deep and code_deep is not v.pacer("code-a") and code_deep is v.pacer("code-a", "deep")
    asyncio.run(core.update_versions({}, 1))  # "code" removed: its classes go with it
    assert all(key[0] is None for key in v._pacers)


def test_an_edge_agent_names_its_draft_class_and_its_rounds_pace_that_class(setup):
    loaded, paths, _ = setup
    core = make_core(loaded, paths)
    draft = noisy_copy(loaded.model, 0.0, seed=3)
    agent = EdgeAgent(ReplicaTransport(core), ModelDrafter(draft, name="tiny-copy"),
                      config=AgentConfig(budget=8, depth_policy="fixed", depth=3))
    try:
        asyncio.run(agent.generate(PROMPTS[0], GREEDY))
    finally:
        agent.close()
    assert agent.draft_class == "tiny-copy/proactive/fixed"
    mine = core.versions._pacers[(None, "tiny-copy/proactive/fixed")]
    assert mine.state()["tokens_per_round"] and not core.versions.base_pacer.state()["tokens_per_round"]


def test_bad_versions_fail_only_their_own_sessions_on_the_replica(setup, tmp_path):
    """A corrupt and a wrong-shape adapter declared beside good ones are unavailable from the
    start (opens 503 ``model_unavailable`` with the reason); a version whose file goes bad later
    fails at its load inside a batch: its session answers 503 (then and after), while the base's
    and another version's sessions verified in that same batch go on exactly."""
    import shutil

    from specdec.protocol import ReplyFrame, VerifyFrame
    from tests.specdec.model.test_lora import corrupt

    loaded, paths, refs = setup
    broken = shutil.copytree(paths["code"], tmp_path / "broken")
    corrupt(str(broken))
    other = load_model("tiny-random", dtype="float32", seed=0, tiny_config={"hidden_size": 96, "num_heads": 6,
                                                                            "num_kv_heads": 2})
    wrong = make_adapter(other.model, tmp_path / "wrong", 3, ALL)
    chat = str(shutil.copytree(paths["chat"], tmp_path / "chat"))

    async def scenario():
        core = make_core(loaded, {"code": paths["code"], "chat": chat, "broken": str(broken), "wrong": wrong})
        st = core.stats()
        assert st["versions"] == ["chat", "code"] and sorted(st["versions_unavailable"]) == ["broken", "wrong"]
        for v, why in (("broken", "cannot be read"), ("wrong", "shape")):
            status, err = await core.open_session("dev", {"prompt_ids": PROMPTS[0], "model": v})
            assert status == 503 and err["error"]["code"] == "model_unavailable" and why in err["error"]["message"]
        sessions, out = {}, {}
        for v in (None, "code", "chat"):
            status, payload = await core.open_session("dev", {"prompt_ids": PROMPTS[2], "model": v,
                                                              "sampling": GREEDY.to_dict()})
            assert status == 200, payload
            sessions[v], out[v] = payload, [payload["first_token"]]
        core.versions.registry.loaded.pop("chat", None)  # evicted: the next batch of it reloads
        corrupt(chat, silently=True)
        batches = []
        verify = core.engine.verify
        core.engine.verify = lambda reqs, *a, **k: (batches.append(len(reqs)), verify(reqs, *a, **k))[1]

        async def step(v):
            s = sessions[v]
            status, reply = await core.verify(s["session_id"], "dev", VerifyFrame(s["prefix_len"], [], []).encode())
            if status == 200:
                r = ReplyFrame.decode(reply)
                s["prefix_len"] = r.prefix_len
                out[v].append(r.bonus)
            return status, reply

        replies = await asyncio.gather(*[step(v) for v in sessions])
        assert batches == [3]  # all three in one batch
        (s0, _), (s1, _), (s2, err) = replies
        assert (s0, s1, s2) == (200, 200, 503) and err["error"]["code"] == "model_unavailable", err
        status, err = await step("chat")  # closed: answers the same from then on
        assert status == 503 and err["error"]["code"] == "model_unavailable"
        while len(out["code"]) < GREEDY.max_tokens:
            assert (await step("code"))[0] == 200 and (await step(None))[0] == 200
        return out

    out = asyncio.run(scenario())
    assert out["code"] == reference_decode(refs["code"], PROMPTS[2], GREEDY)
    assert out[None] == reference_decode(refs[None], PROMPTS[2], GREEDY)


def test_a_user_config_update_is_validated_and_a_bad_one_keeps_the_versions(setup, tmp_path):
    """The Serve user_config goes through the config model: at start an invalid one raises (Serve
    reports the deployment failed); on a running replica it is refused, the versions unchanged and
    the reason in the stats; a user_config without 'adapters' never removes every version."""
    loaded, paths, _ = setup

    async def scenario():
        core = make_core(loaded, paths)
        with pytest.raises(ValueError, match="needs an 'adapters'"):
            await core.apply_user_config({"max_loaded_adapters": 2})  # the first one: at the replica's start
        await core.apply_user_config({"adapters": paths, "max_loaded_adapters": 1})
        status, payload = await core.open_session("dev", {"prompt_ids": PROMPTS[0], "model": "code"})
        assert status == 200
        for bad, why in (({"max_loaded_adapters": 2}, "needs an 'adapters'"),
                         ({"adapters": {"base": paths["code"]}}, "base model's name"),
                         ({"adapters": {"no spaces": paths["code"]}}, "version name"),
                         ({"adapters": {}, "typo": 1}, "unknown keys")):
            await core.apply_user_config(bad)
            st = core.stats()
            assert st["versions"] == ["chat", "code"] and why in st["versions_error"], (bad, st["versions_error"])
            assert payload["session_id"] in core.engine.sessions
        await core.apply_user_config({"adapters": {"code": paths["code"]}})
        st = core.stats()
        assert st["versions"] == ["code"] and st["versions_error"] is None
        assert payload["session_id"] in core.engine.sessions  # "code" unchanged: its session goes on

    asyncio.run(scenario())
