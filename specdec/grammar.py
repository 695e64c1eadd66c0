"""Structured output: a grammar (XGrammar) masks the target's row of every draft-tree node by that
node's path state; the session's emitted tokens advance its matcher. Lossless against target-only
constrained decoding. Why and how: docs/specdec.md, "Grammars through trees".
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.errors import InvalidRequest
from specdec.schema_support import exact_schema
from specdec.tree import DraftTree

if TYPE_CHECKING:  # torch and XGrammar load where a grammar is compiled, never in the router
    import torch

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag")
MAX_GRAMMAR_BYTES = 1 << 17  # a grammar's text on the wire


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: ``kind`` (:data:`KINDS`) and its text (a schema as
    JSON, a regex, EBNF, a JSON list of strings for ``choice``, an XGrammar structural tag as JSON for tool
    calls; empty for ``json_object``)."""

    kind: str
    value: str = ""

    @classmethod
    def of(cls, wire) -> "GrammarSpec":
        """From the session protocol's ``{"kind": ..., "value": ...}``; 400 on anything else."""
        if not isinstance(wire, dict) or set(wire) - {"kind", "value"}:
            raise InvalidRequest("grammar: an object with 'kind' and 'value'")
        kind, value = wire.get("kind"), wire.get("value", "")
        if kind not in KINDS:
            raise InvalidRequest(f"grammar.kind: one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(value, str) or len(value.encode()) > MAX_GRAMMAR_BYTES:
            raise InvalidRequest(f"grammar.value: a string of at most {MAX_GRAMMAR_BYTES} bytes")
        return cls(kind, value)

    def to_wire(self) -> dict:
        return {"kind": self.kind, "value": self.value}

    @property
    def key(self) -> str:
        """Its hash: what the edge and the verifier agree on, and the compiler's cache key."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()[:32]


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequest("guided_choice: a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles grammars for one tokenizer (an HF tokenizer, or a list of token strings) and vocabulary;
    the last ``max_cached`` kept (LRU). Errors are 400s naming the grammar's kind and XGrammar's message."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_cached: int = 64,
                 max_cache_bytes: int = 256 << 20):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self._compiler = None  # built on the first grammar (its tokenizer's vocabulary takes ~0.2 s)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self.max_cached, self.max_cache_bytes = max_cached, max_cache_bytes

    def state_of(self, wire) -> "GrammarState | None":
        """A session's matcher for the protocol's ``grammar`` field (None: no grammar); 400s."""
        if wire is None:
            return None
        spec = GrammarSpec.of(wire)
        if self.tokenizer is None:
            raise InvalidRequest("grammar: this target has no tokenizer to compile a grammar for")
        return self.state(spec)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar (``xgrammar.CompiledGrammar``) of ``spec``."""
        hit = self._cache.get(spec.key)
        if hit is not None:
            self._cache.move_to_end(spec.key)
            return hit
        if self._compiler is None:
            import xgrammar as xgr

            if isinstance(self.tokenizer, list):  # an encoded vocabulary: one string per id
                self.info = xgr.TokenizerInfo(self.tokenizer, vocab_size=self.vocab_size,
                                              stop_token_ids=self.stop_token_ids)
            else:
                self.info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        c = self._compiler
        try:
            if spec.kind in ("json_schema", "json_object"):  # compact: whitespace only where JSON puts it
                schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
                schema = json.dumps(exact_schema(json.loads(schema)))  # (a clear message for text that is not JSON)
                out = c.compile_json_schema(schema, any_whitespace=False)
            elif spec.kind == "regex":
                out = c.compile_regex(spec.value)
            elif spec.kind == "choice":
                out = c.compile_grammar(choice_ebnf(json.loads(spec.value)))
            elif spec.kind == "structural_tag":  # tool calls (specdec.openai.tools)
                out = c.compile_structural_tag(spec.value)
            else:
                out = c.compile_grammar(spec.value)
        except InvalidRequest:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # XGrammar's parse and conversion errors
            raise InvalidRequest(f"grammar ({spec.kind}): {_message(e)}") from None
        self._cache[spec.key] = out
        while len(self._cache) > self.max_cached or (
                len(self._cache) > 1 and self.cache_bytes() > self.max_cache_bytes):
            self._cache.popitem(last=False)
        return out

    def cache_bytes(self) -> int:
        """Memory the compiled grammars kept take."""
        return sum(g.memory_size_bytes for g in self._cache.values())

    def state(self, spec: GrammarSpec) -> "GrammarState":
        """A fresh matcher of ``spec`` for one session."""
        compiled = self.compile(spec)
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size, spec)


def _message(e: Exception) -> str:
    """XGrammar's message without its source location prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def allowed(words: list[int], token: int) -> bool:
    """Whether a bitmask (int32 words, 32 tokens each) allows ``token``."""
    return 0 <= token < 32 * len(words) and bool((words[token >> 5] >> (token & 31)) & 1)


class GrammarState:
    """One session's matcher: its state is the session's emitted tokens."""

    def __init__(self, matcher, vocab_size: int, spec: GrammarSpec):
        import xgrammar as xgr

        self._xgr, self.matcher, self.vocab_size, self.spec = xgr, matcher, vocab_size, spec

    def accept(self, tokens: list[int]) -> None:
        """The session emitted ``tokens`` (each was allowed by its row's mask)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(t)):
                raise InvalidRequest(f"token {t} does not follow the session's grammar")

    def allows(self, tokens) -> bool:
        """Whether the grammar accepts ``tokens`` next (the matcher unchanged)."""
        probe = self.matcher.fork()
        return all(probe.is_terminated() or probe.accept_token(int(t)) for t in tokens)

    def words_after(self, path) -> list[int] | None:
        """The bitmask words (:func:`allowed`) of the token after ``path``, or None where the grammar
        refuses the path or has terminated (the matcher unchanged)."""
        probe = self.matcher.fork()
        if not all(probe.accept_token(int(t)) for t in path) or probe.is_terminated():
            return None
        bits = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        probe.fill_next_token_bitmask(bits, 0)
        return bits[0].tolist()

    def masks(self, tree: DraftTree) -> torch.Tensor:
        """[n + 1, words] int32 bitmask of every row of ``tree`` (row 0: the root's; row a + 1: after
        node a, given its path). The row of a node the grammar refuses allows everything: the walk
        never reads it (its parent's row refuses its token); so do all rows once the grammar has
        terminated (its stop token emitted with ``ignore_eos``). The matcher ends where it began."""
        xgr, m = self._xgr, self.matcher
        out = xgr.allocate_token_bitmask(len(tree) + 1, self.vocab_size)
        out.fill_(-1)
        if m.is_terminated():
            return out
        m.fill_next_token_bitmask(out, 0)
        children: list[list[int]] = [[] for _ in range(len(tree) + 1)]  # by row: parent -1 is row 0
        for a, p in enumerate(tree.parents):
            children[p + 1].append(a)
        stack = [(a, False) for a in reversed(children[0])]
        while stack:
            a, leaving = stack.pop()
            if leaving:
                m.rollback(1)
                continue
            if m.is_terminated() or not m.accept_token(int(tree.tokens[a])):
                continue  # unreachable: its row and its subtree's stay as they are
            if not m.is_terminated():  # (after its stop token a row is not read, or not constrained)
                m.fill_next_token_bitmask(out, a + 1)
            stack.append((a, True))
            stack.extend((c, False) for c in reversed(children[a + 1]))
        return out

    def apply(self, logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """``logits`` [n + 1, V] with every row masked by :meth:`masks` (-inf where refused, and past
        the grammar's vocabulary); a copy."""
        out = logits.clone()
        masks = self.masks(tree)
        if out.is_cuda:
            masks = masks.to(out.device)
        self._xgr.apply_token_bitmask_inplace(out, masks, vocab_size=self.vocab_size)
        out[:, self.vocab_size:] = float("-inf")
        return out
