"""deploy/verifier/grammars.py: a replica's grammars compile off its loop, within a time limit."""

from __future__ import annotations

import asyncio
import threading

import pytest

from deploy.verifier.grammars import ReplicaGrammars
from specdec.errors import InvalidRequest


def test_a_grammar_compiled_past_its_time_limit_is_a_400_and_the_loop_goes_on():
    """deploy/verifier/grammars.py: the compile runs on its own thread; past the limit the open is a
    400 naming the setting, and the compile lands in the cache for the next open."""
    release = threading.Event()

    class SlowCompiler:
        def state_of(self, wire):
            release.wait(5)
            return ("compiled", wire["kind"])

    grammars = ReplicaGrammars(SlowCompiler(), timeout_s=0.05)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            for _ in range(5):
                await asyncio.sleep(0.005)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        with pytest.raises(InvalidRequest, match="grammar_compile_timeout_s"):
            await grammars.state_of({"kind": "regex", "value": "a+"})
        await t
        release.set()
        assert await grammars.state_of({"kind": "regex", "value": "a+"}) == ("compiled", "regex")
        assert await grammars.state_of(None) is None
        return ticks

    assert asyncio.run(main()) == 5  # the loop kept its turns while the compile ran


def test_a_target_without_a_tokenizer_refuses_a_grammar_with_a_400():
    from specdec.grammar import GrammarCompiler

    grammars = ReplicaGrammars(GrammarCompiler(None, 512, (2,)), timeout_s=5)
    with pytest.raises(InvalidRequest, match="tokenizer"):
        asyncio.run(grammars.state_of({"kind": "regex", "value": "a+"}))
    with pytest.raises(InvalidRequest, match="kind"):
        asyncio.run(grammars.state_of({"kind": "xml"}))
