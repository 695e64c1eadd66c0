"""The model-based server-side drafter (server-only speculative decoding baseline)."""

import threading

import pytest

from deploy.config import AppConfig
from deploy.router.server_draft import (DRAFT_THREAD_NAME, ModelServerDrafter, PromptLookupDrafter,
                                        get_server_drafter)
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams


def test_prompt_lookup_stays_the_default_and_by_name():
    assert isinstance(get_server_drafter(AppConfig()), PromptLookupDrafter)
    cfg = AppConfig(server_draft={"model": {"model": "prompt-lookup"}, "depth": 3})
    d = get_server_drafter(cfg)
    assert isinstance(d, PromptLookupDrafter) and d.depth == 3


def _decode(engine, drafter, sids_prompts, params):
    """Round-robin server-only SD over several sessions, as the router interleaves them."""
    hist = {}
    for sid, prompt in sids_prompts:
        (res,) = engine.open([OpenRequest(sid, prompt, params)])
        hist[sid] = (prompt, [res.first_token])
    rounds = 0
    live = [sid for sid, _ in sids_prompts]
    while live:
        for sid in list(live):
            prompt, gen = hist[sid]
            tree = drafter.draft(prompt + gen, 16)
            (res,) = engine.verify([VerifyRequest(sid, tree, len(prompt) + len(gen))])
            gen.extend(res.tokens)
            rounds += 1
            if res.finished:
                live.remove(sid)
    return {sid: g for sid, (_, g) in hist.items()}, rounds


def test_model_drafter_is_lossless_and_keeps_one_cache_per_interleaved_session(tiny_model):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = VerifierEngine(tiny_model)
    drafter = ModelServerDrafter(tiny_model, depth=3)  # the target as its own draft: high acceptance
    prompts = [("a", [5, 6, 7, 8]), ("b", [9, 10, 11, 12, 13])]
    out, rounds = _decode(engine, drafter, prompts, params)
    for sid, p in prompts:
        assert out[sid] == reference_decode(tiny_model, p, params)
    assert rounds < 2 * 24 / 1.5  # speculation emitted more than one token per round
    st = drafter.stats()
    assert st["sessions"] == 2 and st["rounds"] == rounds and st["busy_seconds"] > 0
    assert st["forwards"] <= 3 * rounds


def test_model_drafter_runs_in_its_named_thread(tiny_model):
    drafter = ModelServerDrafter(tiny_model, depth=1)
    drafter.draft([1, 2, 3], 4)
    names = {t.name for t in threading.enumerate()}
    assert any(n.startswith(DRAFT_THREAD_NAME) for n in names)
    (tid,) = [t.native_id for t in threading.enumerate() if t.name.startswith(DRAFT_THREAD_NAME)]
    try:
        comm = open(f"/proc/self/task/{tid}/comm").read().strip()
    except OSError:
        pytest.skip("no /proc")
    assert comm == DRAFT_THREAD_NAME


def test_sampled_requests_get_trees_drawn_from_the_draft_with_their_proposals(tiny_model):
    """Issue 17, item 4: at temperature > 0 server_sd uses the edge's tree-rejection rule (sampled
    trees + proposals, verified by multi-draft rejection sampling); greedy keeps SpecExec trees."""
    from tests.edge_agent.helpers import noisy_copy

    drafter = ModelServerDrafter(noisy_copy(tiny_model, 0.01), depth=3)
    engine = VerifierEngine(tiny_model, eos_token_ids=())
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=24)
    (res,) = engine.open([OpenRequest("s", [5, 9, 11, 7], params)])
    gen, accepted = [res.first_token], 0
    while not engine.sessions["s"].finished:
        tree, props = drafter.draft_round([5, 9, 11, 7] + gen, 16, params)
        assert props is not None and len(props) == len(tree) + 1 and len(tree) > 3
        (res,) = engine.verify([VerifyRequest("s", tree, 4 + len(gen), proposals=props)])
        gen.extend(res.tokens)
        accepted += len(res.accepted)
    assert len(gen) == 24 and accepted > 5
    tree, props = drafter.draft_round([5, 9, 11, 7], 16, SamplingParams())
    assert props is None and len(tree) > 0
    sd = ModelServerDrafter(tiny_model, depth=2, sampled_rule="match")
    assert sd.draft_round([5, 9, 11, 7], 16, params)[1] is None
