"""A replica's target versions: names, the adapter registry, and per-version pacing (FlexSpec §III).

A session names its version at open (``model``; the base by default, or by its own name).
The frozen edge draft accepts differently against each version (FlexSpec §III-C's
"performance collapse" when a fine-tune drifts away from what the draft learned), so with
``pacing.per_version`` each version keeps its own acceptance statistics: its sessions get
the tree budget and depth that its own tokens-per-round make best, while every version
shares the replica's one forward-cost curve (the forward is shared). Off: one pacer for all,
the acceptance of every version mixed. Pure (no Ray).
"""

from __future__ import annotations

import dataclasses

from deploy.verifier.adapters import AdapterRegistry
from deploy.verifier.model import DecoderModel
from deploy.verifier.pacing import Pacer

BASE = "base"  # the metrics label of the base target


class TargetVersions:
    def __init__(self, engine, base_name: str, target_cfg, pacing_cfg, base_pacer: Pacer):
        """``target_cfg``: :class:`deploy.config.ModelConfig`; ``pacing_cfg``: :class:`deploy.config.PacingConfig`."""
        self.engine, self.base_name = engine, base_name
        self.base_aliases = {None, "", BASE, base_name, target_cfg.model}
        model = getattr(engine.runner, "model", None)
        self.registry = AdapterRegistry(model if isinstance(model, DecoderModel) else None,
                                        target_cfg.adapters, target_cfg.max_loaded_adapters)
        engine.adapters = self.registry
        self.per_version = pacing_cfg.per_version
        self.base_pacer = base_pacer
        self._pacers: dict[str, Pacer] = {}

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

    def pacer(self, sid: str) -> Pacer:
        """The pacer whose acceptance statistics this session's hints use."""
        v = self.version(sid)
        if v is None or not self.per_version:
            return self.base_pacer
        if v not in self._pacers:  # own acceptance; the replica's forward cost curve and tree batches
            self._pacers[v] = dataclasses.replace(self.base_pacer, cost=self.base_pacer.cost, _tokens_per_round={},
                                                  _no_tree_hints=0)
        return self._pacers[v]

    def update(self, adapters: dict[str, str], max_loaded: int) -> set[str]:
        """Reconfigure (no restart): returns the versions whose sessions must end."""
        gone = self.registry.update(adapters, max_loaded)
        for v in gone:
            self._pacers.pop(v, None)
        return gone
