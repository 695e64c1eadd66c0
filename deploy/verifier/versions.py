"""A replica's target versions: names, the adapter registry, and per-version pacing (FlexSpec §III).

With ``pacing.per_version``, each version and draft class (``client.draft``) keeps its own acceptance statistics."""

from __future__ import annotations

from deploy.verifier.adapters import AdapterRegistry
from deploy.verifier.pacing import Pacer
from specdec.model.decoder import DecoderModel

BASE = "base"  # the metrics label of the base target


class TargetVersions:
    def __init__(self, engine, base_name: str, target_cfg, pacing_cfg, base_pacer: Pacer):
        """``target_cfg``: :class:`deploy.config.ModelConfig`; ``pacing_cfg``: :class:`deploy.config.PacingConfig`."""
        self.engine, self.base_name = engine, base_name
        self.base_aliases = {None, "", BASE, base_name, target_cfg.model}
        model = getattr(engine.runner, "model", None)
        self.registry = AdapterRegistry(model if isinstance(model, DecoderModel) else None,
                                        target_cfg.adapters, target_cfg.max_loaded_adapters,
                                        getattr(engine.runner, "sync_adapters", None))  # tensor-parallel ranks
        engine.adapters = self.registry
        self.per_version = pacing_cfg.per_version
        self.max_draft_classes = pacing_cfg.max_draft_classes
        self.base_pacer = base_pacer
        self._pacers: dict[tuple[str | None, str | None], Pacer] = {}  # (version, draft class) -> pacer

    def resolve(self, model: str | None) -> str | None:
        """An open request's ``model`` -> the version's adapter name (None: the base); 404 if unknown."""
        if model in self.base_aliases:
            return None
        self.registry.check(model)
        return model

    def names(self) -> list[str]:
        return sorted(self.registry.declared)

    def version(self, sid: str) -> str | None:
        s = self.engine.sessions.get(sid)
        return s.adapter if s is not None else None

    def label(self, sid: str) -> str:
        """The ``version`` metrics label: ``base`` or the version's name (bounded by config)."""
        return self.version(sid) or BASE

    def name_of(self, sid: str) -> str:
        """The model a session is served by, as replies name it."""
        return self.version(sid) or self.base_name

    def pacer(self, sid: str, draft: str | None = None) -> Pacer:
        """The pacer whose acceptance statistics this session's hints use: its version's and draft class's."""
        v = self.version(sid) if self.per_version else None
        if draft is not None and (v, draft) not in self._pacers and self._classes(v) >= self.max_draft_classes:
            draft = None  # this version's classes are all taken: its shared estimates
        if v is None and draft is None:
            return self.base_pacer
        key = (v, draft)
        if key not in self._pacers:  # own acceptance; the replica's forward cost curve and tree batches
            self._pacers[key] = self.base_pacer.with_own_estimates()
        return self._pacers[key]

    def _classes(self, v: str | None) -> int:
        """Draft classes of version ``v`` with estimates of their own (counted only when a new one asks)."""
        return sum(1 for ver, d in self._pacers if ver == v and d is not None)

    def states(self) -> dict[str, dict]:
        """Each own pacer's state (:meth:`Pacer.state`), keyed ``<version or base>|<draft class or *>``."""
        return {f"{v or BASE}|{d or '*'}": p.state() for (v, d), p in self._pacers.items()}

    def update(self, adapters: dict[str, str], max_loaded: int) -> set[str]:
        """Reconfigure (no restart): returns the versions whose sessions must end."""
        gone = self.registry.update(adapters, max_loaded)
        for key in [k for k in self._pacers if k[0] in gone]:
            del self._pacers[key]
        return gone
