"""A replica's grammars (structured output, issue 63): compiled on a thread of their own, so a large
schema never stalls the replica's loop, and refused with a 400 past ``verifier.grammar_compile_timeout_s``
(the compile finishes in the background and is cached; the next open of it is answered at once).
No Ray."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from specdec.errors import InvalidRequest
from specdec.grammar import GrammarCompiler, GrammarSpec, GrammarState


class ReplicaGrammars:
    """``await state_of(wire)``: a session's matcher for an open's ``grammar`` field, or None."""

    @classmethod
    def of(cls, loaded, vc) -> "ReplicaGrammars":
        """For a replica's target (its tokenizer, vocabulary, stop ids) and ``verifier`` config."""
        compiler = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids,
                                   max_cache_bytes=int(vc.grammar_cache_mb * 2**20))
        return cls(compiler, vc.grammar_compile_timeout_s)

    def __init__(self, compiler: GrammarCompiler, timeout_s: float):
        self.compiler, self.timeout_s = compiler, timeout_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")  # the compiler's only user

    async def state_of(self, wire) -> GrammarState | None:
        if wire is None:
            return None
        spec = GrammarSpec.of(wire)  # a malformed field is a 400 at once
        work = asyncio.get_running_loop().run_in_executor(self._thread, self.compiler.state_of, spec.to_wire())
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.timeout_s)
        except asyncio.TimeoutError:
            raise InvalidRequest(f"grammar ({spec.kind}): not compiled within {self.timeout_s:g} s "
                                 "(verifier.grammar_compile_timeout_s); a simpler one, or try again") from None
