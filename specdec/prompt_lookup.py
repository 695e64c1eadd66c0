"""Prompt lookup (n-gram) drafting: propose what followed an earlier occurrence of the context's
longest suffix n-gram (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` speculator).

:class:`NgramIndex` is the one lookup; the edge's :class:`edge_agent.draft_backends.NgramDrafter`
(ranked next tokens per tree node) and the server's
:class:`deploy.router.server_draft.PromptLookupDrafter` (a chain after the latest match) adapt it.
"""

from __future__ import annotations

import math
from collections import defaultdict

Followers = dict[int, list[int]]  # next token -> [count, position of its latest occurrence in the history]


class NgramIndex:
    """The n-grams (``min_n`` to ``max_n`` tokens) of a token history and what followed each.

    Only n-grams followed by a token in the history are indexed, so a context never matches its
    own final suffix. :meth:`extend` indexes only the new tokens when the history extends the last.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.reset()

    def reset(self) -> None:
        self.history: list[int] = []
        # index[n][ngram] = {next_token: [count, last_position]}
        self.index: dict[int, dict[tuple, Followers]] = {
            n: defaultdict(dict) for n in range(self.min_n, self.max_n + 1)}

    def extend(self, history: list[int]) -> None:
        """Index ``history``: incrementally if it extends the indexed one, from scratch otherwise."""
        if history[: len(self.history)] != self.history:
            self.reset()
        for i in range(len(self.history), len(history)):
            for n in range(self.min_n, self.max_n + 1):
                if i - n < 0:
                    break
                entry = self.index[n][tuple(history[i - n : i])].setdefault(history[i], [0, 0])
                entry[0] += 1
                entry[1] = i
        self.history = list(history)

    def followers(self, context: list[int]) -> Followers:
        """What followed the longest suffix of ``context`` (``max_n`` tokens down to ``min_n``) seen in
        the history; ``{}`` when no suffix was seen."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            nxt = self.index[n].get(tuple(context[-n:]))
            if nxt:
                return nxt
        return {}

    def ranked(self, context: list[int], k: int) -> tuple[list[int], list[float]]:
        """The ``k`` likeliest next tokens after ``context``, by count then recency, with log(count/total)."""
        nxt = self.followers(context)
        total = sum(c for c, _ in nxt.values())
        ranked = sorted(nxt.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:k]
        return [t for t, _ in ranked], [math.log(c / total) for _, (c, _) in ranked]

    def continuation(self, context: list[int], k: int) -> list[int]:
        """The (up to) ``k`` history tokens after the latest match of ``context``'s longest seen suffix."""
        nxt = self.followers(context)
        if not nxt or k <= 0:
            return []
        start = max(pos for _, pos in nxt.values())
        return self.history[start : start + k]
