"""Verify rules as objects registered by name (edge_agent/rules.py): the built-in rules and their
fallbacks, and a toy rule registered in one module per side (tests/edge_agent/toy_rule_edge.py,
tests/verifier/toy_rule_verifier.py) run end to end through the real Serve app."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from ray import serve

from deploy.application import build_app
from edge_agent.agent import AgentConfig
from edge_agent.draft_backends import ModelDrafter
from edge_agent.rules import RULES, ChainRejectionRule, TreeRejectionRule
from specdec.protocol import VerifyFrame
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from tests.edge_agent import toy_rule_edge  # noqa: F401  (registers toy-count on the edge)
from tests.edge_agent.test_http_e2e import GREEDY, KEY, app_args, generate, prompts
from tests.serve_apps import delete_app

APP = "toyrule"


def test_the_built_in_rules_are_registered_with_their_fallbacks():
    assert {"match", "tree-rejection", "rejection"} <= set(RULES.names())
    assert TreeRejectionRule().instead(SamplingParams(temperature=0.0)) == "match"
    assert TreeRejectionRule().instead(SamplingParams(temperature=1.0)) is None
    assert ChainRejectionRule().instead(SamplingParams(temperature=1.0, logprobs=2)) == "match"


def test_a_config_naming_an_unregistered_rule_is_refused():
    with pytest.raises(ValueError, match="registered rule"):
        AgentConfig(verify="no-such-rule")
    assert AgentConfig(verify="toy-count").verify == "toy-count"


@pytest.fixture(scope="module")
def toy_server(ray_session):
    args = app_args()
    args["verifier"]["rule_modules"] = ["tests.verifier.toy_rule_verifier"]
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_session['http_port']}/{APP}"
    delete_app(APP)


@pytest.mark.ray
def test_a_toy_rule_registered_on_each_side_runs_end_to_end_exactly(toy_server, target, draft):
    (prompt,) = prompts(1, seed=23)
    ref = reference_decode(target, prompt, SamplingParams(**GREEDY))
    res = asyncio.run(generate(toy_server, ModelDrafter(draft), prompt, verify="toy-count"))
    assert res.token_ids == ref and res.stats.verify_rule == "toy-count"
    assert res.stats.rounds > 0 and res.stats.accepted_tokens > 0 and res.stats.reopens == 0


@pytest.mark.ray
def test_a_rule_the_verifier_lacks_or_a_bad_payload_is_a_400(toy_server):
    async def main():
        async with httpx.AsyncClient(base_url=toy_server, headers={"Authorization": f"Bearer {KEY}"}) as c:
            r = await c.post("/v1/sessions", json={"prompt_ids": [5, 6, 7], "sampling": GREEDY})
            sid = r.json()["session_id"]
            unknown = VerifyFrame(4, [9], [-1], rule="no-such-rule").encode()
            bad = VerifyFrame(4, [9], [-1], rule="toy-count", payload=b"\x07\x00").encode()
            out = [await c.post(f"/v1/sessions/{sid}/verify", content=body) for body in (unknown, bad)]
            await c.delete(f"/v1/sessions/{sid}")
            return out

    unknown, bad = asyncio.run(main())
    assert unknown.status_code == 400 and "no-such-rule" in unknown.text and "toy-count" in unknown.text
    assert bad.status_code == 400 and "payload" in bad.text
