"""edge_agent.server in-process (no Ray): the tiny target behind a LocalTransport, Starlette's test
client. The real clients against the Serve app are in test_serve.py."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from specdec.errors import InvalidRequest, Overloaded
from specdec.engine import VerifierEngine
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from edge_agent.agent import AgentConfig
from edge_agent.draft_backends import ModelDrafter, NgramDrafter
from edge_agent.errors import ConnectionLost, ServerUnreachable
from edge_agent.metrics import EdgeMetrics
from edge_agent.server import AgentPool, EdgeServer, new_drafter_like, openai_error
from edge_agent.transport import LocalTransport, ModelInfo

EOS = 2
PROMPT = [5, 9, 200, 31, 7]


@pytest.fixture
def client(target, draft):
    transport = LocalTransport(VerifierEngine(target, eos_token_ids=(EOS,)), model_name="tiny")
    info = ModelInfo("tiny", target.config.vocab_size, (EOS,), "none", 64, 12, max_model_len=2048)
    server = EdgeServer(AgentPool(transport, ModelDrafter(draft), None, AgentConfig(), max_agents=2), info,
                        EdgeMetrics())
    with TestClient(server.app) as c:
        c.server = server
        yield c


def test_completions_are_the_targets_and_agents_are_reused(client, target):
    want = reference_decode(target, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(3):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 12,
                                                 "ignore_eos": True})
        assert r.status_code == 200 and r.json()["specedge"]["token_ids"] == want
    assert client.server.pool.agents == 1 and client.server.pool.busy == 0  # one after the other: one agent
    assert 'specedge_edge_serve_requests_total{endpoint="completions",status="200"} 3.0' in client.get(
        "/metrics").text


def test_ignored_fields_are_logged_and_named(client, caplog):
    with caplog.at_level(logging.WARNING, logger="edge_agent.server"):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "frobnicate": 1})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "frobnicate"
    assert any("ignored: {'frobnicate'}" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("body,status", [({"messages": [{"role": "user", "content": "hi"}]}, 400),  # no tokenizer
                                         ({"prompt": PROMPT, "top_p": 0}, 400), ({"prompt": "x"}, 400),
                                         ({"prompt": [10 ** 6]}, 400)])  # refused by the verifier's open
def test_bad_requests_are_openai_errors(client, body, status):
    r = client.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == status and err["message"] and err["type"] == "invalid_request_error" and err["code"]
    assert client.server.pool.busy == 0


def test_cloud_failures_become_openai_errors():
    assert openai_error(ServerUnreachable("refused")).status == 503
    assert openai_error(ConnectionLost("reset")).code == "cloud_unavailable"
    shed = Overloaded("busy", retry_after=2.0)
    assert openai_error(shed) is shed
    bad = InvalidRequest("no")
    assert openai_error(bad) is bad
    from edge_agent.errors import error_from_json

    proxy_404 = error_from_json(404, None)  # the proxy's answer where no app is deployed
    assert openai_error(proxy_404).status == 503
    with pytest.raises(KeyError):
        openai_error(KeyError("a bug is not a cloud error"))


def test_new_drafters_share_the_weights(draft):
    d = ModelDrafter(draft, name="d")
    e = new_drafter_like(d)
    assert e.model is d.model and e.runner is not d.runner and e.name == "d"
    assert isinstance(new_drafter_like(NgramDrafter()), NgramDrafter)


@pytest.mark.parametrize("fields", [{"guided_choice": ["yes", "no", "maybe later"]},
                                    {"guided_regex": "[a-c]{2,4}-[0-9]{1,2}"},
                                    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                        "type": "object", "properties": {"ok": {"type": "boolean"}},
                                        "required": ["ok"]}}}}])
@pytest.mark.parametrize("edge_masks", [False, True], ids=["edge-unmasked", "edge-masked"])
def test_structured_output_through_the_edges_trees_is_target_only_constrained_decoding(target, draft, fields,
                                                                                      edge_masks):
    """The verifier masks every node by its path state, whatever the edge drafts (unmasked, or masked
    by the edge's own matcher when it has the tokenizer): the tokens are those of target-only
    constrained greedy decoding (issue 63)."""
    from specdec.grammar import GrammarCompiler
    from specdec.model.loading import load_tokenizer
    from specdec.openai.request import grammar_of

    tok = load_tokenizer("embedded")
    transport = LocalTransport(VerifierEngine(target, eos_token_ids=(EOS,)), model_name="tiny", tokenizer=tok)
    info = ModelInfo("tiny", target.config.vocab_size, (EOS,), "none", 64, 12, max_model_len=2048)
    server = EdgeServer(AgentPool(transport, ModelDrafter(draft), tok if edge_masks else None, AgentConfig(),
                                  max_agents=1), info, EdgeMetrics())
    state = GrammarCompiler(tok, target.config.vocab_size, (EOS,)).state(grammar_of(fields))
    want = reference_decode(target, PROMPT, SamplingParams(max_tokens=24), (EOS,), state)
    with TestClient(server.app) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 24, **fields})
        bad = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "guided_regex": "[a-"})
    assert r.status_code == 200 and r.json()["specedge"]["token_ids"] == want, r.text
    print(f"{fields} edge masks {edge_masks}: tokens/round {r.json()['specedge']['tokens_per_round']:.2f}")
    assert bad.status_code == 400 and "regex" in bad.json()["error"]["message"]


def test_a_grammar_without_a_tokenizer_is_a_400(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "guided_choice": ["a", "b"]})
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
