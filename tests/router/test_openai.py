import pytest

from deploy.errors import InvalidRequest
from deploy.router.openai import completion_response, parse_completion, stream_chunk


@pytest.fixture(scope="module")
def tok():
    from deploy.verifier.models import load_tokenizer

    return load_tokenizer("embedded")


def test_chat_prompt_is_token_ids(tok):
    ids, sampling, stream, mode = parse_completion(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 5, "stream": True}, tok, True)
    assert ids and all(isinstance(i, int) for i in ids)
    assert ids == tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"]
    assert sampling["temperature"] == 0 and sampling["max_tokens"] == 5 and stream and mode == "ar"


def test_completion_prompt_text_or_ids(tok):
    assert parse_completion({"prompt": [5, 6]}, None, False)[0] == [5, 6]
    ids, sampling, _, _ = parse_completion({"prompt": "Hello", "mode": "sd"}, tok, False)
    assert ids == tok("Hello")["input_ids"] and sampling["temperature"] == 1.0  # OpenAI's default


@pytest.mark.parametrize("body,chat", [({}, False), ({"prompt": ""}, False), ({"messages": []}, True),
                                       ({"prompt": "x", "mode": "zz"}, False), ({"prompt": "x", "n": 2}, False),
                                       ({"messages": [{"role": "user"}]}, True)])
def test_bad_requests(tok, body, chat):
    with pytest.raises(InvalidRequest):
        parse_completion(body, tok, chat)


def test_no_tokenizer_needs_ids():
    with pytest.raises(InvalidRequest):
        parse_completion({"prompt": "text"}, None, False)


def test_response_shapes():
    r = completion_response("m", "hi", [1, 2], 3, "stop", True, {})
    assert r["choices"][0]["message"]["content"] == "hi" and r["usage"]["total_tokens"] == 5
    assert stream_chunk("c", "m", "x", None, False).startswith("data: {")
