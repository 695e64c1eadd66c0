"""Edge-side structured output (issue 63 item 3): a drafter whose candidates follow the request's grammar,
so no draft node is spent on a token the verifier's mask refuses. The verifier masks the target
whatever the edge drafts (lossless either way); this only makes drafts count.
"""

from __future__ import annotations

import torch

from edge_agent.draft_backends import Candidates, Drafter, ExpandRequest
from specdec.errors import InvalidRequest
from specdec.grammar import GrammarState, allowed


class GrammarDrafter(Drafter):
    """Wraps ``inner`` for one generation: a node's candidates are the inner drafter's best that the
    grammar allows after the node's path (its state: the generated tokens of the verified prefix,
    past ``prompt_len``, then the path's tokens). A path the grammar refuses is left unmasked."""

    OVERSAMPLE = 8  # inner candidates asked per candidate kept

    def __init__(self, inner: Drafter, state: GrammarState, prompt_len: int):
        self.inner, self.state, self.prompt_len = inner, state, prompt_len
        self.name, self.vocab_size = inner.name, inner.vocab_size
        self.vocab_map = getattr(inner, "vocab_map", None)
        self._taken = 0  # generated tokens the state has accepted

    def _sync(self, prefix: list[int]) -> None:
        new = prefix[self.prompt_len + self._taken:]
        if new and self.state is not None:
            try:
                self.state.accept(new)
            except InvalidRequest:  # out of step with the verifier's: draft unmasked from here on
                self.state = None
        self._taken += len(new)

    def _allowed(self, path: tuple[int, ...]) -> list[int] | None:
        """The grammar's bitmask words after ``path`` (None: no constraint known there)."""
        return None if self.state is None else self.state.words_after(path)

    def expand(self, prefix: list[int], reqs: list[ExpandRequest], k: int) -> list[Candidates]:
        self._sync(prefix)
        out = []
        for r, (toks, lps) in zip(reqs, self.inner.expand(prefix, reqs, k * self.OVERSAMPLE)):
            words = self._allowed(r.path_tokens)
            keep = list(zip(toks, lps)) if words is None else [(t, lp) for t, lp in zip(toks, lps) if allowed(words, t)]
            out.append(([t for t, _ in keep[:k]], [lp for _, lp in keep[:k]]))
        return out

    def next_logits(self, prefix: list[int], reqs: list[ExpandRequest], vocab_size: int) -> list[torch.Tensor | None]:
        self._sync(prefix)
        out = []
        for r, row in zip(reqs, self.inner.next_logits(prefix, reqs, vocab_size)):
            words = self._allowed(r.path_tokens)
            if row is not None and words is not None:
                ids = torch.arange(vocab_size)
                bits = torch.tensor(words, dtype=torch.int64)[ids >> 5] >> (ids & 31) & 1  # [vocab_size]
                masked = row.masked_fill(bits == 0, float("-inf"))
                row = torch.log_softmax(masked, dim=-1) if torch.isfinite(masked).any() else row
            out.append(row)
        return out

    def room(self) -> int:
        return self.inner.room()

    def advance(self, prefix: list[int], path_ids: list[int], live_ids: list[int]) -> None:
        self.inner.advance(prefix, path_ids, live_ids)
        self._sync(prefix)

    def reset(self) -> None:
        self.inner.reset()
