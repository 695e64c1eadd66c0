"""OpenAI-compatible request parsing and validation (pure, no Ray)."""

import json
from dataclasses import replace

import pytest

from specdec.errors import InvalidRequest, InvalidSamplingParams, ModelNotFound
from specdec.grammar import GrammarSpec
from specdec.openai.request import chat_message, check_model, check_sampling, parse_completion
from specdec.openai.response import model_list

VOCAB = 512


def chat_ids(tok, msgs):
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_prompt_is_token_ids(tok):
    req = parse_completion(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 5, "stream": True}, tok, True)
    assert req.prompt == chat_ids(tok, [{"role": "user", "content": "hi"}])
    assert req.sampling["temperature"] == 0 and req.sampling["max_tokens"] == 5
    assert req.stream and req.mode == "ar" and req.chat and req.stop == () and not req.include_usage


def test_completion_prompt_text_or_ids(tok):
    assert parse_completion({"prompt": [5, 6]}, None, False).prompt == [5, 6]
    req = parse_completion({"prompt": "Hello", "mode": "sd"}, tok, False)
    assert req.prompt == tok("Hello")["input_ids"] and req.sampling["temperature"] == 1.0  # OpenAI's default
    assert req.mode == "sd" and req.sampling["max_tokens"] is None  # unset: the rest of the context
    assert req.with_max_tokens(2048).sampling["max_tokens"] == 2048 - len(req.prompt) - 1
    assert parse_completion({"prompt": "Hello", "max_tokens": 9}, tok, False).with_max_tokens(2048).sampling[
        "max_tokens"] == 9


def test_content_parts_join_text_and_assistant_null_is_empty(tok):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    req = parse_completion({"messages": [{"role": "user", "content": parts}]}, tok, True)
    assert req.prompt == chat_ids(tok, [{"role": "user", "content": "Hello\nworld"}])
    assert chat_message(0, {"role": "assistant", "content": None}) == {"role": "assistant", "content": ""}
    assert chat_message(0, {"role": "developer", "content": "be brief"})["role"] == "system"
    # a message echoed back from a response (the client's model_dump) carries null fields
    assert chat_message(0, {"role": "assistant", "content": "x", "tool_calls": None, "refusal": None})["content"] == "x"


@pytest.mark.parametrize("msg", [
    {"role": "user", "content": 5},
    {"role": "user", "content": None},
    {"role": "user"},
    {"content": "hi"},
    {"role": "wizard", "content": "hi"},
    {"role": "tool", "content": "hi"},  # no tool_call_id
    {"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    "hi",
    {"role": "user", "content": []},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
    {"role": "user", "content": [{"type": "text", "text": 3}]},
    {"role": "user", "content": ["hi"]},
    {"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]},
])
def test_bad_messages_are_400(tok, msg):
    with pytest.raises(InvalidRequest):
        parse_completion({"messages": [msg]}, tok, True)


@pytest.mark.parametrize("body,chat", [
    ({}, False), ({"prompt": ""}, False), ({"messages": []}, True), ({"messages": "hi"}, True),
    ({"prompt": "x", "mode": "zz"}, False), ({"prompt": [1, True]}, False), ({"prompt": [1.5]}, False),
    ({"prompt": "x", "n": 2}, False), ({"prompt": "x", "n": "1"}, False), ({"prompt": "x", "n": 1.0}, False),
    ({"prompt": "x", "n": True}, False),
    ({"prompt": "x", "temperature": "hot"}, False), ({"prompt": "x", "temperature": float("nan")}, False),
    ({"prompt": "x", "temperature": float("inf")}, False), ({"prompt": "x", "top_p": 10 ** 400}, False),
    ({"prompt": "x", "temperature": True}, False),
    ({"prompt": "x", "max_tokens": 5.0}, False), ({"prompt": "x", "max_tokens": True}, False),
    ({"prompt": "x", "max_tokens": "5"}, False), ({"prompt": "x", "seed": 1.5}, False),
    ({"prompt": "x", "top_k": False}, False), ({"prompt": "x", "stream": "yes"}, False),
    ({"prompt": "x", "stop_token_ids": [1, "2"]}, False), ({"prompt": "x", "model": 3}, False),
    ({"prompt": "x", "stop": 5}, False), ({"prompt": "x", "stop": ""}, False),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, False), ({"prompt": "x", "stop": ["a", 1]}, False),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, False),  # needs stream
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, False),
    ({"prompt": "x", "stream": True, "stream_options": {"bogus": True}}, False),
])
def test_bad_requests(tok, body, chat):
    with pytest.raises(InvalidRequest):
        parse_completion(body, tok, chat)


@pytest.mark.parametrize("field,value,chat", [
    ("logit_bias", {"5": 10}, True), ("tools", [{"type": "function"}], True), ("tool_choice", "auto", True),
    ("functions", [{"name": "f"}], True), ("function_call", "auto", True),
    ("echo", True, False), ("suffix", "end", False),
    ("best_of", 2, False), ("store", True, True), ("logit_bias", {"5": 10}, False),
])
def test_unimplemented_fields_are_400_naming_the_field(tok, field, value, chat):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    with pytest.raises(InvalidRequest) as e:
        parse_completion({**body, field: value}, tok, chat)
    err = e.value.to_dict()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error" and err["code"] == "invalid_request"
    assert field in err["message"]


@pytest.mark.parametrize("fields,chat", [({"frobnicate": 1}, False), ({"messages": [], "guided_whitespace_pattern": " "}, False),
                                         ({"prompt": "x", "echo": False}, True), ({"spaces_between": True}, True)])
def test_unknown_fields_are_ignored_and_named(tok, fields, chat):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    req = parse_completion({**body, **fields}, tok, chat)
    assert req.ignored == tuple(sorted(fields)) and replace(req, ignored=()) == parse_completion(body, tok, chat)


@pytest.mark.parametrize("body,chat,want", [
    ({"logprobs": True}, True, 0), ({"logprobs": True, "top_logprobs": 5}, True, 5), ({"logprobs": False}, True, None),
    ({}, True, None), ({"logprobs": 3}, False, 3), ({"logprobs": 0}, False, 0), ({}, False, None),
])
def test_logprobs_fields(tok, body, chat, want):
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    req = parse_completion({**base, **body}, tok, chat)
    assert req.logprobs == want and req.sampling["logprobs"] == want


@pytest.mark.parametrize("body,chat,param", [
    ({"top_logprobs": 2}, True, "top_logprobs"), ({"logprobs": 1}, True, "logprobs"),
    ({"logprobs": True}, False, "logprobs"), ({"presence_penalty": "0"}, True, "presence_penalty"),
    ({"repetition_penalty": None, "frequency_penalty": float("nan")}, False, "frequency_penalty"),
    ({"chat_template_kwargs": {"tokenize": False}}, True, "chat_template_kwargs"),
    ({"chat_template_kwargs": [1]}, True, "chat_template_kwargs"),
])
def test_bad_logprobs_penalties_and_template_kwargs_are_400(tok, body, chat, param):
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    with pytest.raises(InvalidRequest) as e:
        parse_completion({**base, **body}, tok, chat)
    assert e.value.to_dict()["error"]["param"] == param


@pytest.mark.parametrize("sampling,param", [({"logprobs": 21}, "logprobs"),
                                            ({"presence_penalty": 2.5}, "presence_penalty"),
                                            ({"frequency_penalty": -3}, "frequency_penalty"),
                                            ({"repetition_penalty": 0}, "repetition_penalty")])
def test_logprobs_and_penalty_ranges_are_the_verifiers(sampling, param):
    body = {"prompt": [1, 2], **sampling}
    with pytest.raises(InvalidSamplingParams) as e:
        check_sampling(parse_completion(body, None, False).sampling, VOCAB)
    assert e.value.to_dict()["error"]["param"] == param


def test_penalties_reach_the_sampling_params(tok):
    body = {"prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2}
    req = parse_completion(body, tok, False)
    assert (req.sampling["presence_penalty"], req.sampling["frequency_penalty"],
            req.sampling["repetition_penalty"]) == (0.5, -1.0, 1.2)
    check_sampling(req.sampling, VOCAB)


def test_chat_template_kwargs_reach_the_template(tok):
    msgs = [{"role": "user", "content": "hi"}]
    plain = parse_completion({"messages": msgs}, tok, True).prompt
    no_gen = parse_completion({"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}}, tok, True)
    assert no_gen.prompt == chat_ids(tok, msgs)[: len(no_gen.prompt)] and len(no_gen.prompt) < len(plain)
    # a variable the template does not use changes nothing (Qwen3's enable_thinking on another template)
    assert parse_completion({"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}, tok,
                            True).prompt == plain


def test_noop_values_and_harmless_fields_are_accepted(tok):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "store": False, "user": "u-1", "metadata": {"k": "v"},
            "top_logprobs": None, "n": 1, "max_completion_tokens": 7, "seed": 3, "top_k": 4, "ignore_eos": True,
            "stop_token_ids": [2], "model": "m", "stream": True, "stream_options": {"include_usage": True},
            "stop": ["\n\n", "END"]}
    req = parse_completion(body, tok, True)
    assert req.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 4, "max_tokens": 7, "seed": 3,
                            "stop_token_ids": [2], "ignore_eos": True, "presence_penalty": 0.0,
                            "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logprobs": None}
    assert req.ignored == ()
    assert req.include_usage and req.stop == ("\n\n", "END") and req.model == "m"
    req = parse_completion({"prompt": "hi", "echo": False, "suffix": None, "best_of": 1, "logprobs": None,
                            "stop": "END"}, tok, False)
    assert req.stop == ("END",)


@pytest.mark.parametrize("sampling", [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1.0},
                                      {"top_p": 0.0}, {"top_k": VOCAB + 1}, {"seed": -1}, {"seed": 2**64},
                                      {"stop_token_ids": [VOCAB]}])
def test_sampling_ranges_are_the_verifiers(sampling):
    body = {"prompt": [1, 2], **sampling}
    with pytest.raises(InvalidSamplingParams):
        check_sampling(parse_completion(body, None, False).sampling, VOCAB)


def test_sampling_defaults_pass_the_verifiers_check():
    check_sampling(parse_completion({"prompt": [1, 2], "temperature": 0, "top_k": 0}, None, False).sampling, VOCAB)


def test_no_tokenizer_needs_ids():
    with pytest.raises(InvalidRequest):
        parse_completion({"prompt": "text"}, None, False)
    with pytest.raises(InvalidRequest):  # stop strings are matched on text
        parse_completion({"prompt": [1, 2], "stop": "x"}, None, False)


def test_model_names():
    check_model(None, ("served", "alias"))
    check_model("alias", ("served", "alias"))
    with pytest.raises(ModelNotFound) as e:
        check_model("gpt-4o", ("served",))
    assert e.value.status == 404 and e.value.to_dict()["error"]["code"] == "model_not_found"
    check_model("code", ("served",), ("code", "docs"))  # a target version
    with pytest.raises(ModelNotFound, match="serves 'served' and its versions 'code', 'docs'"):
        check_model("chat", ("served",), ("code", "docs"))
    assert model_list("served", 7) == {"object": "list", "data": [
        {"id": "served", "object": "model", "created": 7, "owned_by": "specedge"}]}


@pytest.mark.parametrize("body,chat,param", [({"prompt": "x", "n": 2}, False, "n"), ({"prompt": ""}, False, "prompt"),
                                             ({"prompt": "x", "stop": 5}, False, "stop"),
                                             ({"messages": [{"role": "wizard", "content": "hi"}]}, True, "messages[0]"),
                                             ({"messages": []}, True, "messages")])
def test_errors_name_their_field(tok, body, chat, param):
    with pytest.raises(InvalidRequest) as e:
        parse_completion(body, tok, chat)
    assert e.value.to_dict()["error"]["param"] == param


# -- structured output (issue 63) ------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields,kind,value", [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", json.dumps(SCHEMA)),
    ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
    ({"guided_regex": "[a-c]+"}, "regex", "[a-c]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"guided_grammar": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
    ({"structured_outputs": {"regex": "x+"}}, "regex", "x+"),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
    ({"response_format": {"type": "text"}}, None, None),
])
@pytest.mark.parametrize("chat", [True, False])
def test_output_constraints_become_one_grammar(tok, fields, kind, value, chat):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    req = parse_completion({**body, **fields}, tok, chat)
    assert (req.grammar is None) if kind is None else (req.grammar == GrammarSpec(kind, value)) and not req.ignored


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
])
def test_bad_or_several_output_constraints_are_400_naming_the_field(tok, fields, param):
    with pytest.raises(InvalidRequest) as e:
        parse_completion({"messages": [{"role": "user", "content": "hi"}], **fields}, tok, True)
    assert e.value.to_dict()["error"]["param"] == param
