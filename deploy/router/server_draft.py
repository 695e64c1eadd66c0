"""Server-side drafters for clients without a draft model (server-only speculative decoding).

Prompt lookup (training-free n-gram drafting, as in vLLM's ``ngram`` speculator): find
the most recent earlier occurrence of the history's last ``n`` tokens and propose what
followed it as a chain. Costs no model forward, so the server's verify batches carry
the only compute. Pure module.
"""

from __future__ import annotations

from deploy.config import AppConfig
from deploy.verifier.tree import DraftTree


class PromptLookupDrafter:
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, depth: int = 4):
        self.max_ngram, self.min_ngram, self.depth = max_ngram, min_ngram, depth

    def draft(self, history: list[int], budget: int) -> DraftTree:
        k = min(self.depth, budget)
        n_hist = len(history)
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            suffix = history[-n:]
            for start in range(n_hist - n - 1, -1, -1):  # most recent match first
                if history[start : start + n] == suffix:
                    cont = history[start + n : start + n + k]
                    if cont:
                        return DraftTree.chain(cont)
        return DraftTree.empty()


_DRAFTERS: dict[int, PromptLookupDrafter] = {}


def get_server_drafter(cfg: AppConfig) -> PromptLookupDrafter:
    key = cfg.server_draft.depth
    if key not in _DRAFTERS:
        _DRAFTERS[key] = PromptLookupDrafter(depth=cfg.server_draft.depth)
    return _DRAFTERS[key]
