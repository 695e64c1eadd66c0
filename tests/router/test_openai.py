"""OpenAI-compatible parsing, validation, stop strings and response shapes (pure, no Ray)."""

import json

import pytest

from deploy.errors import InvalidRequest, InvalidSamplingParams, ModelNotFound
from deploy.router.openai import (TextStream, chat_message, check_model, check_sampling, completion_response,
                                  find_stop, model_list, parse_completion, stop_prefix_len, stream_chunk,
                                  usage_chunk)

VOCAB = 512


@pytest.fixture(scope="module")
def tok():
    from deploy.verifier.models import load_tokenizer

    return load_tokenizer("embedded")


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
    assert req.mode == "sd" and req.sampling["max_tokens"] == 128


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
    {"role": "tool", "content": "hi", "tool_call_id": "x"},
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
    ("logprobs", True, True), ("top_logprobs", 2, True), ("logprobs", 1, False), ("logprobs", 0, False),
    ("presence_penalty", 0.5, True), ("frequency_penalty", -1, False), ("presence_penalty", "0", True),
    ("logit_bias", {"5": 10}, True), ("tools", [{"type": "function"}], True), ("tool_choice", "auto", True),
    ("functions", [{"name": "f"}], True), ("function_call", "auto", True),
    ("response_format", {"type": "json_object"}, True), ("echo", True, False), ("suffix", "end", False),
    ("best_of", 2, False), ("store", True, True),
    ("frobnicate", 1, False), ("messages", [], False), ("prompt", "x", True), ("echo", False, True),
])
def test_unimplemented_and_unknown_fields_are_400(tok, field, value, chat):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    with pytest.raises(InvalidRequest):
        parse_completion({**body, field: value}, tok, chat)


def test_noop_values_and_harmless_fields_are_accepted(tok):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "store": False, "user": "u-1", "metadata": {"k": "v"},
            "top_logprobs": None, "n": 1, "max_completion_tokens": 7, "seed": 3, "top_k": 4, "ignore_eos": True,
            "stop_token_ids": [2], "model": "m", "stream": True, "stream_options": {"include_usage": True},
            "stop": ["\n\n", "END"]}
    req = parse_completion(body, tok, True)
    assert req.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 4, "max_tokens": 7, "seed": 3,
                            "stop_token_ids": [2], "ignore_eos": True}
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


def test_find_stop_and_prefix():
    assert find_stop("hello world", ("wor", "lo")) == 3 and find_stop("abc", ("x",)) is None
    assert find_stop("abc", ()) is None
    assert stop_prefix_len("hello wo", ("world",)) == 2 and stop_prefix_len("hello", ("world",)) == 0
    assert stop_prefix_len("ab", ("abc", "bx")) == 2


def feed(stream: TextStream, pieces: list[str]) -> tuple[list[str], bool]:
    text, out, stopped = "", [], False
    for i, piece in enumerate(pieces):
        text += piece
        delta, stopped = stream.push(text, final=i == len(pieces) - 1)
        out.append(delta)
        if stopped:
            break
    return out, stopped


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_text_stream_never_sends_part_of_a_stop_string(split):
    full = "The answer is 42.\nEND of story"
    pieces = [full[i:i + split] for i in range(0, len(full), split)]
    out, stopped = feed(TextStream(("\nEND",)), pieces)
    assert stopped and "".join(out) == "The answer is 42."
    assert not any("\n" in d for d in out)


def test_text_stream_flushes_a_held_tail_at_the_end_and_waits_for_utf8():
    out, stopped = feed(TextStream(("END",)), ["ab", "cE", "N"])
    assert out == ["ab", "c", "EN"] and not stopped
    s = TextStream()
    assert s.push("caf\ufffd", final=False) == ("caf", False)
    assert s.push("café", final=True) == ("é", False)


def test_response_shapes():
    r = completion_response("m", "hi", [1, 2], 3, "stop", True, {})
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "hi"} and r["usage"]["total_tokens"] == 5
    assert completion_response("m", "hi", [1], 1, None, False, {})["choices"][0]["finish_reason"] == "length"
    chunk = json.loads(stream_chunk("c", "m", "x", None, True, role=True, with_usage=True)[6:])
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "x"} and chunk["usage"] is None
    assert "usage" not in json.loads(stream_chunk("c", "m", "x", None, False)[6:])
    last = json.loads(usage_chunk("c", "m", True, 3, 4, cached_tokens=2)[6:])
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                                       "prompt_tokens_details": {"cached_tokens": 2}}
