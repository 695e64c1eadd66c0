"""Target versions on a replica: declared, loaded on first use, evicted LRU (FlexSpec §III-B).

Modelled on Ray Serve's model multiplexing (``@serve.multiplexed``,
``max_num_models_per_replica``): a version (a LoRA adapter, :mod:`deploy.verifier.lora`)
is read from disk the first time a forward needs it, and the least recently used ones are
dropped once more than ``max_loaded`` are held. A forward that needs more versions than
that holds them all for its duration (as a multiplexed model still serving a request
outlives its eviction) and the set is trimmed back after it. A session's KV stays valid
across an eviction: a reload reads the same weights.

``update`` is the no-restart path (the deployment's ``reconfigure``): versions may be
added, removed or re-pointed; it names the ones whose sessions must end. Pure torch, no Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from deploy.errors import ModelNotFound, UnsupportedModel
from deploy.verifier.lora import AdapterConfig, LoraAdapter


class AdapterRegistry:
    def __init__(self, model=None, declared: dict[str, str] | None = None, max_loaded: int = 4):
        """``model``: the replica's :class:`deploy.verifier.model.DecoderModel` (None: a runner
        whose weights live elsewhere, e.g. pipeline stages, which serves the base only)."""
        self.model = model
        self.declared: dict[str, str] = {}
        self.max_loaded = max_loaded
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.loads = self.evictions = 0
        self.update(declared or {}, max_loaded)

    # -- declared versions -----------------------------------------------------------
    def update(self, declared: dict[str, str], max_loaded: int) -> set[str]:
        """Take a new set of versions (validated before anything changes); returns the names
        whose sessions must end: removed, or re-pointed to other weights."""
        if declared and self.model is None:
            raise UnsupportedModel("LoRA target versions need the replica to hold the model "
                                   "(verifier.pipeline_parallel_size 1)")
        for path in declared.values():
            AdapterConfig.read(path)
        gone = {n for n, p in self.declared.items()
                if n not in declared or Path(declared[n]).resolve() != Path(p).resolve()}
        for n in gone:
            if self.loaded.pop(n, None) is not None:
                self.evictions += 1
        self.declared, self.max_loaded = dict(declared), max_loaded
        self.trim()
        return gone

    def check(self, name: str | None) -> None:
        """404 ``model_not_found`` unless ``name`` is a declared version (None: the base)."""
        if name is not None and name not in self.declared:
            known = ", ".join(sorted(self.declared)) or "none"
            raise ModelNotFound(f"target version {name!r} is not served here (versions: {known})")

    # -- loading ---------------------------------------------------------------------
    def activate(self, names: set[str]) -> None:
        """Make ``names`` loaded for the next forward (loading missing ones, evicting least
        recently used others beyond ``max_loaded``) and hand them to the model."""
        for n in sorted(names):
            self.check(n)
            if n in self.loaded:
                self.loaded.move_to_end(n)
            else:
                self.loaded[n] = self._load(n)
                self.loads += 1
        self.trim(keep=names)
        self.model.adapters = self.loaded

    def trim(self, keep: set[str] = frozenset()) -> None:
        """Evict least recently used versions (but not ``keep``) down to ``max_loaded``."""
        for n in [n for n in self.loaded if n not in keep][: max(len(self.loaded) - self.max_loaded, 0)]:
            del self.loaded[n]
            self.evictions += 1

    def _load(self, name: str) -> LoraAdapter:
        m = self.model
        return LoraAdapter.load(name, self.declared[name], m.spec, m.config.intermediate_size, m.dtype, m.device,
                                range(m.first, m.last))

    def held(self) -> list[str]:
        return list(self.loaded)

    def loaded_bytes(self) -> int:
        return sum(a.nbytes for a in self.loaded.values())
