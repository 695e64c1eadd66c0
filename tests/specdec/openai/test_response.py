"""OpenAI-compatible stop strings and response shapes (pure, no Ray)."""

import json

import pytest

from specdec.protocol import TokenLogprob
from specdec.openai.response import (TextStream, completion_response, find_stop, logprobs_object, stop_prefix_len,
                                     stream_chunk, usage_chunk)


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


def test_logprobs_objects(tok):
    hello, world = tok("Hello world", add_special_tokens=False)["input_ids"][:2]
    lps = [TokenLogprob(hello, -0.5, (hello, world), (-0.5, -1.5)),
           TokenLogprob(world, -1.0, (world, hello), (-1.0, -2.0))]
    chat = logprobs_object(tok, lps, True)["content"]
    assert [c["token"] for c in chat] == ["Hello", " world"] and chat[1]["logprob"] == -1.0
    assert chat[0]["top_logprobs"][1] == {"token": " world", "logprob": -1.5, "bytes": list(b" world")}
    cmpl = logprobs_object(tok, lps, False, offset=3)
    assert cmpl == {"tokens": ["Hello", " world"], "token_logprobs": [-0.5, -1.0],
                    "top_logprobs": [{"Hello": -0.5, " world": -1.5}, {" world": -1.0, "Hello": -2.0}],
                    "text_offset": [3, 8]}
    assert logprobs_object(tok, None, True) is None
    assert logprobs_object(None, lps[:1], False)["tokens"] == [f"token_id:{hello}"]
