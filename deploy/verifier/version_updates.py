"""Target versions changed on a running replica, without a restart (FlexSpec §III-B).

An invalid update fails the start, or is refused on a running replica (docs/verifier.md, "Target versions")."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from deploy.config import AppConfig, versions_update
from deploy.verifier.versions import TargetVersions

log = logging.getLogger("ray.serve")


class VersionUpdates:
    """Applies version updates to one replica. ``on_worker(fn)``: runs ``fn`` on the replica's
    worker thread; ``end_session(sid, gone)``: ends a session whose version is in ``gone``."""

    def __init__(self, cfg: AppConfig, versions: TargetVersions, engine,
                 on_worker: Callable[[Callable], Awaitable], end_session: Callable[[str, set[str]], None]):
        self.cfg, self.versions, self.engine = cfg, versions, engine
        self.on_worker, self.end_session = on_worker, end_session
        self.error: str | None = None  # why the last update was refused
        self._configured = False  # an update took effect (the first one runs at start)

    async def update(self, adapters: dict[str, str], max_loaded: int) -> dict:
        """Add, remove or re-point versions; new ones are validated first (a bad one is listed unavailable)."""
        def apply():
            gone = self.versions.update(adapters, max_loaded)
            return gone, self.engine.drop_versions(gone)

        gone, sids = await self.on_worker(apply)
        for sid in sids:
            self.end_session(sid, gone)
        if gone:
            log.info("target versions removed or changed: %s (%d sessions closed)", sorted(gone), len(sids))
        return {"versions": self.versions.names(), "removed": sorted(gone), "closed_sessions": len(sids),
                "unavailable": dict(self.versions.registry.unavailable)}

    async def apply_user_config(self, user_config: dict) -> None:
        """Serve's ``user_config``: validated, then applied; refused on a running replica when invalid."""
        try:
            target = versions_update(self.cfg, user_config).target
        except ValueError as e:
            if not self._configured:
                raise
            self.error = str(e)
            log.error("target versions update refused, the served versions are unchanged: %s", e)
            return
        await self.update(target.adapters, target.max_loaded_adapters)
        self._configured, self.error = True, None
