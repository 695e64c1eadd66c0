"""benchmarks.prefix_cache on the embedded model, two short conversations: turn 2 finds turn 1 and
its answer cached, nothing is cached with the cache off, and the answers are the same tokens (the
run raises otherwise)."""

from __future__ import annotations

from benchmarks.prefix_cache import run, table


def test_turn_two_finds_turn_one_and_its_answer_cached():
    r = run("embedded", "float32", n=2, max_tokens=12)
    s = r["summary"]
    assert s["off/turn1"]["cached_tokens"] == s["off/turn2"]["cached_tokens"] == 0
    assert s["on/turn1"]["cached_tokens"] >= 16  # the second conversation: the chat template's system prompt
    # turn 2 holds turn 1 (~70 tokens) and the answer: all but the tail from the first changed token on
    assert s["on/turn2"]["cached_tokens"] >= 0.5 * s["on/turn2"]["prompt_tokens"]
    assert s["on/turn1"]["prompt_tokens"] == s["off/turn1"]["prompt_tokens"]
    assert "| turn2 |" in table(r)
