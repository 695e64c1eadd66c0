"""Server-side drafters for clients without a draft model (``mode: sd``, server-only speculative decoding).

:func:`get_server_drafter`: :class:`PromptLookupDrafter` or :class:`ModelServerDrafter` (SpecEdge §5's server-only
baseline); the router calls ``draft_round(history, budget, params)``. Why: docs/router.md, "Server-only decoding"."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from deploy.config import AppConfig
from specdec import clock
from specdec.tree import DraftTree

DRAFT_THREAD_NAME = "srv-draft"  # what /proc/<pid>/task/<tid>/comm shows for the drafting thread
PROMPT_LOOKUP_NAMES = ("prompt-lookup", "ngram")


class PromptLookupDrafter:
    """vLLM's ``ngram`` speculator: the ``depth`` tokens after the latest match of the history's suffix, as a chain."""

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

    def draft_round(self, history: list[int], budget: int, params=None) -> tuple[DraftTree, None]:
        return self.draft(history, budget), None  # lookups are not samples of a q: sample-then-match


def _name_thread(name: str) -> None:
    """Give the calling OS thread a name visible in /proc (Linux; a no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class ModelServerDrafter:
    """The edge's tree drafter on the server: one draft KV cache per live generation.
    At most ``max_sessions`` caches (LRU); a round feeds only the history past the cache it extends."""

    def __init__(self, model, depth: int = 4, topk: int = 4, max_expand: int = 8, max_sessions: int = 64,
                 max_depth: int = 32, sampled_rule: str = "tree-rejection"):
        self.model = model
        self.sampled_rule = sampled_rule
        self.depth, self.topk, self.max_expand, self.max_depth = depth, topk, max_expand, max_depth
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[int, object] = OrderedDict()  # key -> DraftSession (LRU order)
        self._keys = iter(range(1 << 62))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=DRAFT_THREAD_NAME,
                                        initializer=_name_thread, initargs=(DRAFT_THREAD_NAME,))
        self._lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)  # draws
        self.busy_seconds = 0.0  # wall-clock seconds inside draft forwards (all sessions)
        self.forwards = 0
        self.rounds = 0

    def stats(self) -> dict:
        return {"busy_seconds": self.busy_seconds, "forwards": self.forwards, "rounds": self.rounds,
                "sessions": len(self._sessions), "depth": self.depth}

    def _session_for(self, history: list[int]):
        from edge_agent.draft_backends import ModelDrafter, common_prefix
        from edge_agent.draft_session import DraftSession

        best, best_len = None, 0
        for key, ds in self._sessions.items():
            n = common_prefix(ds.prefix, history)
            if n == len(ds.prefix) and n > best_len:  # this history extends that session's
                best, best_len = key, n
        if best is not None:
            self._sessions.move_to_end(best)
            return self._sessions[best]
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
        ds = DraftSession(ModelDrafter(self.model, name="server-draft"))
        self._sessions[next(self._keys)] = ds
        return ds

    def _draft(self, history: list[int], budget: int, params=None) -> tuple[DraftTree, list | None]:
        from edge_agent.tree_builder import TreeConfig

        t0 = clock.perf_counter()
        with self._lock:
            ds = self._session_for(history)
            n0 = len(ds.forward_times)
            cfg = TreeConfig(budget=max(1, budget), topk=self.topk, max_expand=self.max_expand,
                             max_depth=self.max_depth)
            ds.start(list(history), cfg)
            proposals = None
            if params is not None and not params.greedy and self.sampled_rule == "tree-rejection":
                from edge_agent.sampled_tree import SampledTreeSession

                st = SampledTreeSession(ds.drafter, self.model.config.vocab_size, params, self._generator,
                                        cfg, forward_times=ds.forward_times)
                st.prefix = list(history)  # ds.start advanced the draft KV to it
                st.draft(self.depth)
                (tree, _order), proposals = st.freeze(), st.proposals()
            else:
                ds.draft(self.depth)
                tree, _order = ds.freeze(0)
            self.forwards += len(ds.forward_times) - n0
            del ds.forward_times[:]
            self.rounds += 1
            self.busy_seconds += clock.perf_counter() - t0
        return tree, proposals

    def draft(self, history: list[int], budget: int) -> DraftTree:
        return self.draft_round(history, budget)[0]

    def draft_round(self, history: list[int], budget: int, params=None) -> tuple[DraftTree, list | None]:
        """A tree for ``history`` and, for a sampled tree (temperature > 0, tree-rejection), its proposals."""
        return self._pool.submit(self._draft, list(history), budget, params).result()


def load_server_drafter(cfg: AppConfig):
    """Build the drafter ``cfg.server_draft`` describes (see the module docstring)."""
    sd = cfg.server_draft
    mc = sd.model
    if mc is None or mc.model in PROMPT_LOOKUP_NAMES:
        return PromptLookupDrafter(depth=sd.depth)
    from specdec.model.loading import load_model

    if mc.model == "embedded-draft" or mc.model.endswith(".safetensors"):
        from edge_agent.embedded_draft import load_draft

        target = cfg.target.model if not cfg.target.model.startswith("tiny") else None
        model = load_draft(target, mc.model, dtype=mc.dtype, device=mc.device)
    else:
        tok = mc.tokenizer if mc.tokenizer is not None else None
        model = load_model(mc.model, dtype=mc.dtype, device=mc.device, attn_implementation=mc.attn_implementation,
                           tokenizer=tok, seed=mc.seed, tiny_config=mc.tiny_config).model
    return ModelServerDrafter(model, depth=sd.depth, max_depth=cfg.verifier.max_tree_depth,
                              sampled_rule=sd.sampled_rule)


_DRAFTERS: dict[str, object] = {}


def get_server_drafter(cfg: AppConfig):
    """The process-wide drafter for this config (loaded once)."""
    key = cfg.server_draft.model_dump_json()
    if key not in _DRAFTERS:
        _DRAFTERS[key] = load_server_drafter(cfg)
    return _DRAFTERS[key]
