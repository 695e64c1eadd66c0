"""Version updates (deploy/verifier/version_updates.py) without a model: a refused user_config keeps
the versions and says why; an applied one ends only the sessions of the versions it removed.
(On a replica with real adapters: tests/verifier/test_versions.py.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from deploy.config import AppConfig
from deploy.verifier.version_updates import VersionUpdates


class FakeVersions:
    def __init__(self):
        self.served, self.registry = {"code": "/v/code"}, SimpleNamespace(unavailable={})

    def update(self, adapters, max_loaded):
        gone = {v for v in self.served if v not in adapters or adapters[v] != self.served[v]}
        self.served = dict(adapters)
        return gone

    def names(self):
        return sorted(self.served)


def test_a_refused_update_keeps_the_versions_and_an_applied_one_ends_only_their_sessions():
    versions, ended = FakeVersions(), []
    engine = SimpleNamespace(drop_versions=lambda gone: [f"s-{v}" for v in sorted(gone)])

    async def on_worker(fn):
        return fn()

    up = VersionUpdates(AppConfig(), versions, engine, on_worker, lambda sid, gone: ended.append((sid, gone)))

    async def scenario():
        with pytest.raises(ValueError, match="needs an 'adapters'"):  # at the replica's start: raised
            await up.apply_user_config({"max_loaded_adapters": 2})
        await up.apply_user_config({"adapters": {"code": "/v/code", "docs": "/v/docs"}})
        assert up.error is None and versions.names() == ["code", "docs"] and ended == []
        await up.apply_user_config({"max_loaded_adapters": 2})  # running: refused, not raised
        assert "needs an 'adapters'" in up.error and versions.names() == ["code", "docs"]
        out = await up.update({"code": "/v/code"}, 1)
        assert out["removed"] == ["docs"] and out["closed_sessions"] == 1 and ended == [("s-docs", {"docs"})]

    asyncio.run(scenario())
