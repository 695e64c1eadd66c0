"""vLLM's /tokenize, /detokenize and /version answers (pure, no Ray)."""

import pytest

from specdec.errors import InvalidRequest
from specdec.openai.vllm import detokenize, server_version, tokenize
from tests.specdec.openai.test_request import VOCAB, chat_ids


def test_tokenize_detokenize_version(tok):
    out = tokenize({"prompt": "Hello world"}, tok, 2048)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 2048 and out["token_strs"] is None
    assert detokenize({"tokens": out["tokens"]}, tok, VOCAB * 100)["prompt"] == "Hello world"
    msgs = [{"role": "user", "content": "hi"}]
    assert tokenize({"messages": msgs}, tok, 2048)["tokens"] == chat_ids(tok, msgs)
    assert tokenize({"prompt": "Hi", "return_token_strs": True}, tok, 9)["token_strs"] == tok.convert_ids_to_tokens(
        tok("Hi")["input_ids"])
    for bad in ({}, {"prompt": 5}, {"prompt": "a", "messages": msgs}):
        with pytest.raises(InvalidRequest):
            tokenize(bad, tok, 2048)
    for bad in ({"tokens": [VOCAB]}, {"tokens": "x"}, {}):
        with pytest.raises(InvalidRequest):
            detokenize(bad, tok, VOCAB)
    assert server_version()["version"]
