"""Target versions on a replica: declared, loaded on first use, evicted LRU (FlexSpec §III-B).

A version failing validation, or changed on disk, is *unavailable* (503); docs/verifier.md, "Target versions"."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

from specdec.errors import ModelNotFound, SpecError, UnsupportedModel, VersionUnavailable
from specdec.model.lora import LoraAdapter, check, fingerprint

log = logging.getLogger("ray.serve")


class AdapterRegistry:
    def __init__(self, model=None, declared: dict[str, str] | None = None, max_loaded: int = 4, sync=None):
        """``model``: the replica's DecoderModel (None: weights elsewhere, as pipeline stages: the base only);
        ``sync``: a tensor-parallel group's ``TPRunner.sync_adapters``, given the versions rank 0 holds."""
        self.model, self.sync = model, sync
        self.declared: dict[str, str] = {}
        self.fingerprints: dict[str, tuple] = {}  # name -> its files' fingerprint when validated
        self.unavailable: dict[str, str] = {}  # declared versions that cannot be served -> why
        self.max_loaded = max_loaded
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.loads = self.evictions = 0
        self.update(declared or {}, max_loaded)

    # -- declared versions -----------------------------------------------------------
    def update(self, declared: dict[str, str], max_loaded: int) -> set[str]:
        """Take a new set of versions (new and changed ones validated); returns those whose sessions must end."""
        if declared and self.model is None:
            raise UnsupportedModel("LoRA target versions need the replica to hold the model "
                                   "(verifier.pipeline_parallel_size 1)")
        prints = {n: fingerprint(p) for n, p in declared.items()}
        changed = {n for n, p in declared.items() if n not in self.declared or prints[n] != self.fingerprints[n]
                   or Path(p).resolve() != Path(self.declared[n]).resolve()}
        unavailable = {n: why for n, why in self.unavailable.items() if n in declared and n not in changed}
        for n in sorted(changed):
            try:
                check(declared[n], *self.model.adapter_base())
            except UnsupportedModel as e:
                unavailable[n] = str(e)
                log.error("target version %r is unavailable: %s", n, e)
        gone = {n for n in self.declared if n not in declared or n in changed}
        for n in gone:
            if self.loaded.pop(n, None) is not None:
                self.evictions += 1
        self.declared, self.fingerprints, self.unavailable = dict(declared), prints, unavailable
        self.max_loaded = max_loaded
        self._evict()
        self._publish({})  # the other ranks drop what is gone
        return gone

    def check(self, name: str | None) -> None:
        """404 ``model_not_found`` unless ``name`` is a declared version (None: the base);
        503 ``model_unavailable`` if its adapter cannot be served."""
        if name is not None and name not in self.declared:
            known = ", ".join(sorted(self.declared)) or "none"
            raise ModelNotFound(f"target version {name!r} is not served here (versions: {known})")
        if name in self.unavailable:
            raise VersionUnavailable(f"target version {name!r} is unavailable: {self.unavailable[name]}")

    def served(self) -> list[str]:
        """Declared versions that can be served (not unavailable)."""
        return sorted(n for n in self.declared if n not in self.unavailable)

    # -- loading ---------------------------------------------------------------------
    def activate(self, names: set[str]) -> dict[str, SpecError]:
        """Load ``names`` for the next forward (LRU beyond ``max_loaded``); returns those unservable, with errors."""
        failed: dict[str, SpecError] = {}
        for n in sorted(names):
            try:
                self.check(n)
                if n in self.loaded:
                    self.loaded.move_to_end(n)
                else:
                    self.loaded[n] = self._load(n)
                    self.loads += 1
            except SpecError as e:
                failed[n] = e
            except (UnsupportedModel, OSError) as e:  # unreadable, corrupt or changed on disk: this version only
                self.unavailable[n] = str(e) if isinstance(e, UnsupportedModel) else f"{self.declared[n]}: {e}"
                log.error("target version %r is unavailable: %s", n, self.unavailable[n])
                failed[n] = VersionUnavailable(f"target version {n!r} is unavailable: {self.unavailable[n]}")
        self._evict(keep=set(names) - set(failed))
        self._publish(failed)
        self.model.adapters = self.loaded
        return failed

    def _publish(self, failed: dict[str, SpecError]) -> None:
        """The versions held here to the other tensor-parallel ranks (``sync``); one a rank could not load is
        unavailable (into ``failed``) and dropped here too."""
        if self.sync is None:
            return
        for n, why in self.sync({n: (self.declared[n], self.fingerprints[n]) for n in self.loaded}).items():
            self.loaded.pop(n, None)
            self.unavailable[n] = why
            log.error("target version %r is unavailable: %s", n, why)
            failed[n] = VersionUnavailable(f"target version {n!r} is unavailable: {why}")

    def trim(self) -> None:
        """Evict least recently used versions down to ``max_loaded`` (after a forward that needed more); the other
        tensor-parallel ranks drop them too."""
        if self._evict():
            self._publish({})

    def _evict(self, keep: set[str] = frozenset()) -> bool:
        """Evict least recently used versions (but not ``keep``) down to ``max_loaded``; whether any went."""
        gone = [n for n in self.loaded if n not in keep][: max(len(self.loaded) - self.max_loaded, 0)]
        for n in gone:
            del self.loaded[n]
            self.evictions += 1
        return bool(gone)

    def _load(self, name: str) -> LoraAdapter:
        m, path = self.model, self.declared[name]
        if fingerprint(path) != self.fingerprints[name]:  # sessions' KV was computed with the validated bytes
            raise UnsupportedModel(f"{path} changed on disk since it was declared; re-declare it by a config "
                                   "update (its sessions end then)")
        return m.load_adapter(name, path)

    def held(self) -> list[str]:
        return list(self.loaded)

    def loaded_bytes(self) -> int:
        return sum(a.nbytes for a in self.loaded.values())
