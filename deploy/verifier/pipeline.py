"""Pipeline-parallel verifier: one replica's target sharded over N Ray stage actors.

:class:`PipelineRunner`, a runner for :class:`~specdec.engine.VerifierEngine`; docs/verifier.md, "Pipeline stages"."""

from __future__ import annotations

import functools
import logging
import threading

import ray
import torch

from deploy.config import EarlyExitConfig, ModelConfig
from deploy.verifier.kv_sizing import Sizing
from deploy.verifier.layer_split import Weighting, split_layers
from deploy.verifier.pipeline_stage import PipelineStage, StageExits, exit_layers, target_config
from deploy.verifier.tensor_parallel import tp_runner
from specdec.errors import KVStateLost
from specdec.model.batch import SeqInput
from specdec.model.loading import LoadedModel, load_target
from specdec.model.native import PAGE_SIZE
from specdec.model.runner import Keep, ModelRunner

log = logging.getLogger("ray.serve")

STAGE_BUNDLE_OFFSET = 1  # bundle 0 is the replica; stage i lives in bundle i + 1


# -- placement ------------------------------------------------------------------------
def stage_resources(device: str = "cpu", cpus_per_stage: float = 1.0,
                    gpus_per_stage: float | None = None) -> dict[str, float]:
    """Ray resources of one stage: its CPUs and, on CUDA, its own GPU (1 unless given)."""
    gpus = gpus_per_stage if gpus_per_stage is not None else (1.0 if device == "cuda" else 0.0)
    if device == "cuda" and gpus <= 0:
        raise ValueError("device 'cuda' needs gpus_per_stage > 0 (each stage owns its GPU)")
    res = {"CPU": float(cpus_per_stage), "GPU": float(gpus)}
    res = {k: v for k, v in res.items() if v > 0}
    if not res:
        raise ValueError("a pipeline stage needs some CPU or GPU")
    return res


def pipeline_bundles(pp: int, device: str = "cpu", cpus_per_stage: float = 1.0,
                     gpus_per_stage: float | None = None, replica_cpus: float = 1.0) -> list[dict] | None:
    """``placement_group_bundles`` for a verifier replica with ``pp`` stages.
    ``[{"CPU": replica_cpus}, stage_0, ..., stage_{pp-1}]``, None for ``pp == 1``; the replica asks for bundle 0."""
    if pp < 1:
        raise ValueError("pipeline_parallel_size must be >= 1")
    if pp == 1:
        return None
    if replica_cpus <= 0:
        raise ValueError("the replica's bundle needs CPU > 0")
    stage = stage_resources(device, cpus_per_stage, gpus_per_stage)
    return [{"CPU": float(replica_cpus)}] + [dict(stage) for _ in range(pp)]


def pipeline_deployment_options(pp: int, device: str = "cpu", cpus_per_stage: float = 1.0,
                                gpus_per_stage: float | None = None, replica_cpus: float = 1.0) -> dict:
    """Serve deployment options for a verifier replica (merge into ``.options(...)``).
    ``ray_actor_options``, and for ``pp > 1`` the placement group of :func:`pipeline_bundles` (``PACK``)."""
    if pp == 1:
        opts = {"num_cpus": float(replica_cpus)}
        gpus = gpus_per_stage if gpus_per_stage is not None else (1.0 if device == "cuda" else 0.0)
        if gpus:
            opts["num_gpus"] = float(gpus)
        return {"ray_actor_options": opts}
    return {"ray_actor_options": {"num_cpus": float(replica_cpus)},
            "placement_group_bundles": pipeline_bundles(pp, device, cpus_per_stage, gpus_per_stage, replica_cpus),
            "placement_group_strategy": "PACK"}


# -- the driver side ------------------------------------------------------------------
class PipelineRunner:
    """A ModelRunner look-alike backed by ``pp`` stage actors (thread-safe).
    ``bounds``: stage boundaries ``[0, b1, ..., n]`` (default: balanced); ``loaded``: metadata, a ModelShell."""

    def __init__(self, model_cfg: ModelConfig, pipeline_parallel_size: int = 2, *,
                 bounds: list[int] | None = None, weighting: Weighting = "flops",
                 cpus_per_stage: float | None = None, gpus_per_stage: float | None = None,
                 torch_threads: int | None = None, use_placement_group: bool = True,
                 kv_capacity_tokens: int = 1 << 16, compile: bool = False,
                 early_exit: EarlyExitConfig | None = None, prefix_caching: bool = False,
                 sizing: Sizing | None = None, tensor_parallel_size: int = 1):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tp = tensor_parallel_size  # > 1: stage i is rank 0 of its group in bundle 1 + i tp, its ranks behind it

        pp = pipeline_parallel_size
        if bounds is None:
            slices = split_layers(target_config(model_cfg), pp, weighting)
        else:
            if len(bounds) != pp + 1 or bounds[0] != 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
                raise ValueError(f"bounds {bounds} are not {pp} increasing stage boundaries from 0")
            slices = list(zip(bounds[:-1], bounds[1:]))
        self.slices = slices
        self.model_cfg = model_cfg
        pg = ray.util.get_current_placement_group() if use_placement_group else None
        if pg is not None and len(pg.bundle_specs) < pp * tp + STAGE_BUNDLE_OFFSET:
            raise ValueError(f"the replica's placement group has {len(pg.bundle_specs)} bundles; "
                             f"{pp} stages of {tp} ranks need {pp * tp + STAGE_BUNDLE_OFFSET} (see pipeline_bundles, "
                             f"deploy/verifier/tensor_parallel.py)")
        actor_cls = ray.remote(PipelineStage)
        self.stages = []
        for i, (a, b) in enumerate(slices):
            bundle = i * tp + STAGE_BUNDLE_OFFSET
            if pg is not None and cpus_per_stage is None and gpus_per_stage is None:
                res = dict(pg.bundle_specs[bundle])  # the whole bundle is the stage's
            else:  # "auto" asks for no GPU: the replica cannot see which devices stages would get
                res = stage_resources(model_cfg.device, 1.0 if cpus_per_stage is None else cpus_per_stage,
                                      gpus_per_stage)
            threads = torch_threads or max(1, int(res.get("CPU", 1)))
            opts: dict = {"num_cpus": res.get("CPU", 0.0), "num_gpus": res.get("GPU", 0.0),
                          "max_restarts": 0, "max_task_retries": 0}  # no retries: keeps per-actor order
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle)
            group = None
            if tp > 1:  # the stage actor is rank 0 of its group, its other ranks in the bundles behind its own
                group = functools.partial(tp_runner, model_cfg, tp, first=a, last=b, pg=pg,
                                          bundles=list(range(bundle + 1, bundle + tp)),
                                          cpus_per_rank=res.get("CPU", 1.0), gpus_per_rank=res.get("GPU", 0.0),
                                          torch_threads=threads, kv_capacity_tokens=kv_capacity_tokens,
                                          compile=compile, prefix_caching=prefix_caching)
            self.stages.append(actor_cls.options(**opts).remote(model_cfg, a, b, threads, kv_capacity_tokens, compile,
                                                                early_exit, prefix_caching, sizing, group))
        self.loaded: LoadedModel = ray.get(self.stages[0].describe.remote())
        ray.get([s.stats.remote() for s in self.stages])  # every stage loaded
        self.exit_heads: StageExits | None = None  # the exits the stages hold (the engine's ``exit_heads``)
        self._exit_stages: dict[int, tuple[int, ...]] = {}  # stage index -> its exit layers
        if early_exit is not None and early_exit.enabled:
            want = exit_layers(early_exit)
            info = ray.get([s.exit_info.remote() for s in self.stages])
            self._exit_stages = {i: layers for i, (layers, _) in enumerate(info) if layers}
            held = tuple(sorted(x for layers in self._exit_stages.values() for x in layers))
            if held != want:  # an exit at or past the last layer: no stage runs it
                raise ValueError(f"early_exit.layers {list(want)}: exits must be in 1..{slices[-1][1] - 1}")
            self.exit_heads = StageExits(held, next(ids for _, ids in info if ids is not None))
        self._lock = threading.Lock()
        self._lengths: dict[str, int] = {}
        self._batches: dict[int, set[str]] = {}  # sessions of each batch in flight (minus drops)
        self._background: list = []  # refs of fire-and-forget calls (commit, drop, truncate)

    @property
    def pipeline_parallel_size(self) -> int:
        return len(self.stages)

    # -- background calls ---------------------------------------------------------------
    def _reap(self) -> None:
        """Collect finished fire-and-forget calls (lock held); log their errors."""
        if not self._background:
            return
        done, self._background = ray.wait(self._background, num_returns=len(self._background), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - a drop/truncate of a session that is gone anyway
                log.exception("a pipeline stage's drop/truncate failed")

    def _broadcast(self, method: str, *args) -> None:
        self._background.extend(getattr(s, method).remote(*args) for s in self.stages)

    def sync(self) -> None:
        """Wait for every pending commit/drop/truncate on every stage."""
        with self._lock:
            refs, self._background = self._background, []
        ray.get(refs)

    # -- the ModelRunner interface -----------------------------------------------------
    def kv_length(self, sid: str) -> int:
        with self._lock:
            return self._lengths.get(sid, 0)

    def kv_tokens(self) -> int:
        with self._lock:
            return sum(self._lengths.values())

    def kv_used_tokens(self) -> int:
        """Whole pages held on each stage (committed lengths rounded up to pages)."""
        with self._lock:
            return sum(-(-n // PAGE_SIZE) * PAGE_SIZE for n in self._lengths.values())

    def forward(self, batch_id: int, items: list[SeqInput], hidden: torch.Tensor | None = None, on_layer=None):
        """Chain the stages; returns one logits tensor [len(logit_rows), vocab] per item.
        ``on_layer``: an :class:`~specdec.exit_heads.EarlyExit`, walked with each exit stage's logits when done."""
        if hidden is not None:
            raise ValueError("a PipelineRunner takes token ids; hidden states stay between its stages")
        exits = self._exit_stages if on_layer is not None else {}
        early_refs = []
        with self._lock:  # one submission order for every stage: batches cannot cross
            self._reap()
            if batch_id in self._batches:
                raise ValueError(f"batch {batch_id} is already in flight")
            self._batches[batch_id] = {it.sid for it in items}
            items_ref = ray.put(items)
            ref = None
            for i, stage in enumerate(self.stages):
                if i in exits:
                    ref, early = stage.forward_early.options(num_returns=2).remote(batch_id, items_ref, ref,
                                                                                   on_layer.picks)
                    early_refs.append(early)
                else:
                    ref = stage.forward.remote(batch_id, items_ref, ref)
        for early in early_refs:  # stage order: each is ready when its stage is done
            got = ray.get(early)
            on_layer.seconds += got["seconds"]
            on_layer.cpu_seconds += got["cpu_seconds"]
            for layer in sorted(got["rows"]):
                on_layer.walk(layer, got["rows"][layer])
        try:
            return ray.get(ref)
        except KVStateLost as e:  # a stage's tensor-parallel group restarted empty: every stage drops every session
            with self._lock:
                lost = sorted(self._lengths)
                self._lengths.clear()
                self._batches.pop(batch_id, None)
                for sid in lost:
                    self._broadcast("drop", sid)
            raise KVStateLost(f"a pipeline stage lost its KV ({type(e).__name__}); every session re-opens from "
                              "history", sessions=sorted(set(lost) | set(getattr(e, "sessions", ())))) from None

    def commit(self, batch_id: int, keep: dict[str, Keep]) -> None:
        with self._lock:
            self._reap()
            for sid in self._batches.pop(batch_id):
                if sid in keep:  # a session dropped while its forward ran has left the batch's set
                    n_contiguous, tree_positions = keep[sid]
                    self._lengths[sid] = self._lengths.get(sid, 0) + n_contiguous + len(tree_positions)
            refs = [s.commit.remote(batch_id, keep) for s in self.stages]
        ray.get(refs)  # a failure belongs to this batch: raised here, not into the next one

    def abort(self, batch_id: int) -> None:
        with self._lock:
            if self._batches.pop(batch_id, None) is not None:
                self._broadcast("abort", batch_id)

    def drop(self, sid: str) -> None:
        with self._lock:
            self._lengths.pop(sid, None)
            for sids in self._batches.values():
                sids.discard(sid)
            self._broadcast("drop", sid)

    def truncate(self, sid: str, length: int) -> None:
        with self._lock:
            cur = self._lengths[sid]  # KeyError for an unknown session
            if not 0 <= length <= cur:
                raise ValueError(f"cannot truncate KV of length {cur} to {length}")
            self._lengths[sid] = length
            self._broadcast("truncate", sid, length)

    def share_prefix(self, sid: str, tokens: list[int], salt=None) -> int:
        """Every stage starts ``sid`` on its cached pages of the tokens' prefix; all are cut to the fewest found."""
        with self._lock:
            self._reap()
            found = ray.get([s.share_prefix.remote(sid, tokens, salt) for s in self.stages])
            n = min(found)
            for stage, m in zip(self.stages, found):
                if m > n:
                    self._background.append(stage.truncate.remote(sid, n))
            if n:
                self._lengths[sid] = n
            return n

    def cache_prefix(self, sid: str, tokens: list[int], salt=None) -> None:
        with self._lock:
            self._broadcast("cache_prefix", sid, tokens, salt)

    def prefix_stats(self) -> dict | None:
        """None: the pages are the stages' (each stage's ``prefix_stats``); the replica reports tokens."""
        return None

    # -- inspection ------------------------------------------------------------------
    def session_kv(self, sid: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A session's KV gathered from all stages: keys, values [L, H, length, d]."""
        self.sync()
        parts = ray.get([s.session_kv.remote(sid) for s in self.stages])
        if any(p is None for p in parts):
            if all(p is None for p in parts):
                return None
            raise RuntimeError(f"session {sid!r} has KV on some stages only")
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def stage_stats(self) -> list[dict]:
        """Per stage: layers, busy seconds (forward + commit compute), wall seconds, forwards."""
        return ray.get([s.stats.remote() for s in self.stages])

    def busy_intervals(self) -> list[list[tuple[float, float]]]:
        """Per stage, (start, end) of its recent forwards (for overlap/bubble analysis)."""
        return ray.get([s.busy_intervals.remote() for s in self.stages])

    def reset_stats(self) -> None:
        ray.get([s.reset_stats.remote() for s in self.stages])

    def shutdown(self) -> None:
        for s in self.stages:
            ray.kill(s)
        self.stages = []


# -- the factory the verifier deployment calls ------------------------------------------
def build_runner(model_cfg: ModelConfig, pipeline_parallel_size: int = 1, *, cpus_per_stage: float | None = None,
                 gpus_per_stage: float | None = None, torch_threads: int | None = None,
                 weighting: Weighting = "flops", kv_capacity_tokens: int = 1 << 16,
                 compile: bool = False, early_exit: EarlyExitConfig | None = None,
                 prefix_caching: bool = False, sizing: Sizing | None = None,
                 tensor_parallel_size: int = 1) -> ModelRunner | PipelineRunner:
    """The runner of a verifier replica; ``runner.loaded`` is what its engine is built from.
    pp == 1: a ModelRunner over the whole target; pp > 1: a :class:`PipelineRunner` (``loaded.model``: a ModelShell)."""
    if pipeline_parallel_size == 1:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        loaded = load_target(model_cfg, weights_only=True)
        runner = ModelRunner(loaded.model, kv_capacity_tokens=kv_capacity_tokens, compile=compile,
                             prefix_caching=prefix_caching)
        runner.loaded = loaded  # type: ignore[attr-defined]
        return runner
    return PipelineRunner(model_cfg, pipeline_parallel_size, weighting=weighting, cpus_per_stage=cpus_per_stage,
                          gpus_per_stage=gpus_per_stage, torch_threads=torch_threads,
                          kv_capacity_tokens=kv_capacity_tokens, compile=compile, early_exit=early_exit,
                          prefix_caching=prefix_caching, sizing=sizing, tensor_parallel_size=tensor_parallel_size)
