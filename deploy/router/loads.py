"""The router's one-time loads: the target's tokenizer and the server drafter.

Each once, at first use, in a worker thread with its heavy imports. Why: docs/router.md, "The one-time loads"."""

from __future__ import annotations

import asyncio

from deploy.config import AppConfig


class Loads:
    """One-time loads for one router replica (``cfg``: its :class:`~deploy.config.AppConfig`)."""

    def __init__(self, cfg: AppConfig):
        self.cfg = cfg
        self._loaded: dict[str, object] = {}
        self._lock = asyncio.Lock()

    async def once(self, key: str, load):
        """``load()`` run once, in a worker thread; ``load`` does its own imports."""
        if key not in self._loaded:
            async with self._lock:
                if key not in self._loaded:
                    self._loaded[key] = await asyncio.to_thread(load)
        return self._loaded[key]

    async def tokenizer(self):
        """The target's tokenizer (None for tiny test models), loaded with torch and jinja2 for later requests."""

        def load():
            import jinja2  # noqa: F401

            import specdec.sampling  # noqa: F401
            from specdec.model.loading import load_tokenizer

            return load_tokenizer(self.cfg.target.model, self.cfg.target.tokenizer)

        return await self.once("tokenizer", load)

    async def server_drafter(self):
        """The drafter of ``mode: sd`` requests (deploy/router/server_draft.py)."""

        def load():
            from deploy.router.server_draft import get_server_drafter  # imports in the worker thread too

            return get_server_drafter(self.cfg)

        return await self.once("drafter", load)
