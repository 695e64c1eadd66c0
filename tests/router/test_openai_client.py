"""The OpenAI-compatible endpoints driven by the official ``openai`` client (real Ray Serve,
tiny random target with the embedded model's tokenizer)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch
from ray import serve

from tests.router.test_app import deploy
from tests.serve_apps import delete_app

pytestmark = pytest.mark.ray

APP = "oai"
KEY, ONE_KEY = "oai-key-12345", "one-key-12345"
TENANTS = [{"name": "oai", "api_key": KEY, "max_sessions": 8},
           {"name": "one", "api_key": ONE_KEY, "max_sessions": 1}]
TARGET = {"model": "tiny-random", "dtype": "float32", "tokenizer": "embedded"}  # vocabulary: the tokenizer's
CHAT = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def url(ray_session):
    yield deploy(APP, {"target": TARGET, "router": {"tenants": TENANTS}}, ray_session)
    delete_app(APP)


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(url):
    with client(url) as c:
        yield c


@pytest.fixture(scope="module")
def served(oai) -> str:
    return oai.models.list().data[0].id


def test_models_list_and_retrieve(url, oai, served):
    models = oai.models.list().data
    assert [m.id for m in models] == [served] and served.startswith("tiny-random")
    assert models[0].object == "model" and models[0].owned_by == "specedge" and models[0].created > 0
    assert oai.models.retrieve(served).id == served
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")
    with pytest.raises(openai.AuthenticationError):
        client(url, "not-a-key").models.list()


def test_chat_string_and_content_parts(oai, served):
    r = oai.chat.completions.create(model=served, messages=CHAT, temperature=0, max_tokens=6)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}]
    r2 = oai.chat.completions.create(model=served, messages=parts, temperature=0, max_tokens=6)
    assert r2.choices[0].message.content == r.choices[0].message.content  # one part == the plain string
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_stream_with_usage_matches_non_streaming(oai, served):
    args = dict(model=served, messages=CHAT, temperature=0, max_tokens=8)
    whole = oai.chat.completions.create(**args)
    chunks = list(oai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in deltas) and deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_completion_stop_string_cuts_the_text(oai, served, stream):
    args = dict(model=served, prompt="Once upon a time", temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    full = oai.completions.create(**args).choices[0].text
    k = next(i for i in range(len(full) // 2, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[k:k + 2]
    expected = full[:full.find(stop)]
    if stream:
        chunks = list(oai.completions.create(**args, stop=[stop], stream=True))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        r = oai.completions.create(**args, stop=stop)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == expected and finish == "stop"


@pytest.mark.parametrize("error,args", [
    (openai.NotFoundError, {"model": "gpt-4o"}),
    (openai.BadRequestError, {"logit_bias": {"5": 3}}),
    (openai.BadRequestError, {"top_logprobs": 3}),  # needs logprobs
    (openai.BadRequestError, {"n": 2}),
    (openai.BadRequestError, {"n": "two"}),
    (openai.BadRequestError, {"presence_penalty": 3.0}),
    (openai.BadRequestError, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}),  # not a tool
    (openai.BadRequestError, {"response_format": {"type": "json_schema"}}),  # no json_schema object
    (openai.BadRequestError, {"extra_body": {"guided_regex": "[a-"}}),  # a regex that does not parse
    (openai.BadRequestError, {"messages": [{"role": "user", "content": 5}]}),
    (openai.BadRequestError, {"messages": [{"content": "no role"}]}),
    (openai.BadRequestError, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                         "image_url": {"url": "http://x/y.png"}}]}]}),
    (openai.BadRequestError, {"extra_body": {"repetition_penalty": 0}}),
    (openai.BadRequestError, {"max_tokens": 0}),
    (openai.BadRequestError, {"temperature": 500, "stream": True}),  # refused before the stream starts
    (openai.BadRequestError, {"top_p": 0, "stream": True}),
])
def test_unsupported_or_invalid_requests_are_4xx(oai, served, error, args):
    args = {"model": served, "messages": CHAT, "max_tokens": 4, **args}
    with pytest.raises(error) as e:
        oai.chat.completions.create(**args)
    assert e.value.status_code in (400, 404) and e.value.body["code"] in ("invalid_request", "invalid_sampling_params",
                                                                          "model_not_found")


def test_refused_open_answers_its_own_status_not_a_stream(url, served):
    with client(url) as c:  # a prompt id outside the vocabulary: the verifier's open refuses it
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=served, prompt=[10 ** 6], max_tokens=4, stream=True)


def sessions(url: str) -> int:
    return httpx.get(url + "/v1/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["sessions"]


def wait_for_no_sessions(url: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while sessions(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sessions(url) == 0, "the abandoned generation still holds its server session"


LONG = dict(prompt="Tell a long story", temperature=0, max_tokens=4000)  # ~1 min of rounds: never done in time


def test_abandoned_stream_closes_its_session(url, served):
    assert sessions(url) == 0
    with client(url, ONE_KEY) as c:
        stream = c.completions.create(model=served, **LONG, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        assert sessions(url) == 1
        stream.close()  # the client goes away mid-generation
        wait_for_no_sessions(url)
        # the tenant's one slot is free again (its quota counts open sessions)
        r = c.completions.create(model=served, prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens >= 1


def test_abandoned_request_closes_its_session(url, served):
    body = {"model": served, **LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and drops the connection
        httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {ONE_KEY}"}, timeout=1.0)
    wait_for_no_sessions(url)
    with client(url, ONE_KEY) as c:
        assert c.completions.create(model=served, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


# -- vLLM-level API: ignored fields, error objects, logprobs, penalties, tokenizer endpoints -------
def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.fixture(scope="module")
def target():
    from deploy.config import ModelConfig
    from specdec.model.loading import load_model

    return load_model(TARGET["model"], dtype="float32", tokenizer=TARGET["tokenizer"],
                      seed=ModelConfig(**TARGET).seed).model


def test_unknown_fields_are_ignored_and_named_in_a_header(url, oai, served):
    r = post(url, "/v1/chat/completions", {"model": served, "messages": CHAT, "max_tokens": 2, "temperature": 0,
                                           "frobnicate": 1, "guided_whitespace_pattern": " "})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "frobnicate, guided_whitespace_pattern"
    assert "x-ignored-fields" not in post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).headers
    raw = oai.chat.completions.with_raw_response.create(model=served, messages=CHAT, max_tokens=2,
                                                        extra_body={"frobnicate": 1})
    assert raw.headers["x-ignored-fields"] == "frobnicate" and raw.parse().choices[0].message.content is not None


@pytest.mark.parametrize("body,status,param", [({"logit_bias": {"5": 3}}, 400, "logit_bias"),
                                               ({"tools": [{"type": "function"}]}, 400, "tools"),
                                               ({"response_format": {"type": "xml"}}, 400, "response_format"),
                                               ({"temperature": "hot"}, 400, "temperature"),
                                               ({"top_p": 0}, 400, "top_p"), ({"model": "gpt-4o"}, 404, None)])
def test_errors_carry_message_type_param_code(url, served, body, status, param):
    r = post(url, "/v1/chat/completions", {"model": served, "messages": CHAT, "max_tokens": 2, **body})
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == param and err["message"] and err["code"]
    assert err["type"] == ("invalid_request_error" if status == 400 else "not_found_error")


def reference_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out), vocab]: the target's float32 log-softmax at each emitted position."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out])).logits[0].float()  # [L, vocab]
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(out) - 1], -1)


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_chat_logprobs_are_the_targets(oai, served, target, mode):
    r = oai.chat.completions.create(model=served, messages=CHAT, temperature=0, max_tokens=8, logprobs=True,
                                    top_logprobs=3, extra_body={"mode": mode, "ignore_eos": True})
    ids, prompt_len = r.model_extra["specedge"]["token_ids"], r.usage.prompt_tokens
    prompt = oai.post("/../tokenize", cast_to=object, body={"messages": CHAT})["tokens"]  # the same template
    assert len(prompt) == prompt_len
    ref = reference_logprobs(target, prompt, ids)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids) == 8
    assert torch.allclose(torch.tensor([c.logprob for c in content]), ref[range(len(ids)), ids], atol=1e-4)
    for c, row in zip(content, ref):
        assert len(c.top_logprobs) == 3
        assert torch.allclose(torch.tensor([t.logprob for t in c.top_logprobs]), torch.topk(row, 3).values, atol=1e-4)


def test_streamed_completion_logprobs_cover_every_token(oai, served, target):
    prompt = [5, 9, 200, 31, 7]
    chunks = list(oai.completions.create(model=served, prompt=prompt, temperature=0.8, seed=4, max_tokens=10,
                                         logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    lps = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    whole = oai.completions.create(model=served, prompt=prompt, temperature=0.8, seed=4, max_tokens=10, logprobs=2,
                                   extra_body={"ignore_eos": True})
    ids = whole.model_extra["specedge"]["token_ids"]
    ref = reference_logprobs(target, prompt, ids)
    assert torch.allclose(torch.tensor(whole.choices[0].logprobs.token_logprobs), ref[range(len(ids)), ids], atol=1e-4)
    assert lps == whole.choices[0].logprobs.token_logprobs  # a seeded sample repeats, streamed or not


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_greedy_penalised_output_is_penalised_target_decoding(oai, served, target, mode):
    from specdec.reference import reference_decode
    from specdec.sampling import SamplingParams

    prompt = [5, 9, 200, 31, 7, 9, 9]
    pen = dict(presence_penalty=-2.0, frequency_penalty=-1.0)  # a flat random target: pull towards repeats
    want = reference_decode(target, prompt, SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=0.5,
                                                           **pen))
    assert want != reference_decode(target, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    r = oai.completions.create(model=served, prompt=prompt, temperature=0, max_tokens=24, **pen,
                               extra_body={"repetition_penalty": 0.5, "mode": mode, "ignore_eos": True})
    assert r.model_extra["specedge"]["token_ids"] == want


def test_chat_template_kwargs_and_max_tokens_default(url, oai, served):
    base = oai.chat.completions.create(model=served, messages=CHAT, max_tokens=1)
    no_gen = oai.chat.completions.create(model=served, messages=CHAT, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert no_gen.usage.prompt_tokens < base.usage.prompt_tokens
    max_len = post(url, "/tokenize", {"prompt": "x"}).json()["max_model_len"]
    prompt = [7] * (max_len - 5)  # max_tokens unset: the rest of the context
    r = oai.completions.create(model=served, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and 1 <= r.usage.completion_tokens <= 4


def test_tokenize_detokenize_version(url, served):
    t = post(url, "/tokenize", {"model": served, "prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0
    assert post(url, "/detokenize", {"model": served, "tokens": t["tokens"]}).json() == {"prompt": "Hello world"}
    assert post(url, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert post(url, "/tokenize", {"model": "gpt-4o", "prompt": "x"}).status_code == 404
    from importlib.metadata import version

    assert httpx.get(url + "/version", timeout=30).json()["version"] == version("specedge-serve")
    assert httpx.get(url + "/v1/model", timeout=30).json()["version"] == version("specedge-serve")  # as edge-agent --version


# -- structured output (issue 63): the grammar masks the target at every node ----------------------
def test_structured_output_through_the_official_client(oai, served):
    """guided_choice, guided_regex, a json_schema response_format and ``chat.completions.parse``: the
    text follows the constraint and finishes with "stop" (grammars a random target closes quickly)."""
    import json
    import re
    from typing import Literal

    from pydantic import BaseModel

    r = oai.chat.completions.create(model=served, messages=CHAT, temperature=0, max_tokens=20,
                                    extra_body={"guided_choice": ["yes", "no", "maybe later"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe later") and r.choices[0].finish_reason == "stop"
    r = oai.completions.create(model=served, prompt="Code:", temperature=0.8, seed=3, max_tokens=20,
                               extra_body={"guided_regex": "[a-c]{3}-[0-9]"})
    assert re.fullmatch("[a-c]{3}-[0-9]", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = oai.chat.completions.create(model=served, messages=CHAT, temperature=0, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    doc = json.loads(r.choices[0].message.content)
    assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and doc["n"] in (1, 2, 3)

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        confident: bool

    parsed = oai.chat.completions.parse(model=served, messages=CHAT, temperature=0, max_tokens=40,
                                        response_format=Verdict).choices[0].message.parsed
    assert isinstance(parsed, Verdict)


def test_a_bad_grammar_is_a_400_naming_it_and_the_server_goes_on(oai, served):
    with pytest.raises(openai.BadRequestError, match="objectx"):
        oai.chat.completions.create(model=served, messages=CHAT, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        oai.chat.completions.create(model=served, messages=CHAT, max_tokens=5,
                                    extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert oai.chat.completions.create(model=served, messages=CHAT, max_tokens=2).choices[0].message.content is not None


# -- tool calls (issue 63): forced by the grammar, parsed into tool_calls ------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}


def check_tool_flows(c: openai.OpenAI, model: str) -> None:
    """The official client's tools flow (a forced call, its result sent back, a named call streamed) and a pydantic
    tool through ``chat.completions.parse``, then LangChain's ``bind_tools``; ``c``: the cloud's or the edge's."""
    import json
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Lookup(BaseModel):
        topic: Literal["sky", "sea"]
        detailed: bool

    r = c.chat.completions.create(model=model, messages=CHAT, tools=[WEATHER], tool_choice="required", temperature=0,
                                  max_tokens=60, parallel_tool_calls=False)  # a random target would go on calling
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    answered = CHAT + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    r = c.chat.completions.create(model=model, messages=answered, tools=[WEATHER], temperature=0, max_tokens=6)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with c.chat.completions.stream(model=model, messages=CHAT, tools=[WEATHER], temperature=0, max_tokens=60,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}}) as s:
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls[0].function.name == "get_weather"
    r = c.chat.completions.parse(model=model, messages=CHAT, tools=[openai.pydantic_function_tool(Lookup)],
                                 tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60)
    assert isinstance(r.choices[0].message.tool_calls[0].function.parsed_arguments, Lookup)
    llm = ChatOpenAI(base_url=str(c.base_url), api_key=c.api_key, model=model, temperature=0, max_tokens=60,
                     max_retries=0)
    msg = llm.bind_tools([Lookup], tool_choice="any", parallel_tool_calls=False).invoke([("user", "Look up the sky")])
    assert msg.tool_calls[0]["name"] == "Lookup" and Lookup(**msg.tool_calls[0]["args"])


def test_tool_calls_through_the_official_client_and_langchain(oai, served):
    check_tool_flows(oai, served)


def test_a_grammar_cut_by_max_tokens_finishes_with_length_never_as_complete(oai, served):
    """A schema that cannot close in 4 tokens: ``finish_reason`` "length", and the client's ``parse`` refuses it
    (OpenAI's LengthFinishReasonError) rather than returning a parsed object; a forced tool call likewise."""
    from pydantic import BaseModel

    class Person(BaseModel):
        first_name: str
        last_name: str
        city: str

    r = oai.chat.completions.create(model=served, messages=CHAT, temperature=0, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):
        oai.chat.completions.parse(model=served, messages=CHAT, max_tokens=4, response_format=Person)
    r = oai.chat.completions.create(model=served, messages=CHAT, tools=[WEATHER], tool_choice="required", max_tokens=4)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
