"""Tensor parallelism in a verifier replica (issue 64): the checks before anything loads, the placement group, the
workers as Ray actors, and the memory of one rank. The model and the group: specdec/model/tensor_parallel.py and
specdec/model/tp_runner.py; docs/tensor_parallel.md.

Placement: a replica of ``tp`` ranks and ``pp`` stages holds ``tp x pp`` devices in one ``STRICT_PACK`` placement
group (one node: the reductions run every layer). With one stage, rank 0 runs in the replica's own process (bundle
0 holds its device) and ranks 1..tp-1 are :class:`TPWorker` actors in bundles 1..tp-1; with stages, bundle 0 is
the replica (CPU only) and stage ``s`` holds bundles ``1 + s tp .. s tp + tp``: its stage actor is rank 0."""

from __future__ import annotations

import logging

from deploy.config import AppConfig, ModelConfig, split_problems
from deploy.verifier.kv_sizing import Shape, activation_bytes
from specdec.model.tp_runner import ShardSpec, TPRunner, serve_rank

log = logging.getLogger("ray.serve")


# -- checks ------------------------------------------------------------------------------------
def replica_devices(cfg: AppConfig) -> int:
    """Devices (GPUs on CUDA, CPU shares otherwise) one replica's ranks hold: tensor x pipeline size."""
    return cfg.verifier.tensor_parallel_size * cfg.verifier.pipeline_parallel_size


def placement_problem(cfg: AppConfig, nodes: list[dict]) -> str | None:
    """Why no node of ``nodes`` (``ray.nodes()``: alive ones with their ``Resources``) can hold one replica's
    ``STRICT_PACK`` group, or None. Without any GPU node yet (an autoscaler adds them) nothing is judged."""
    vc = cfg.verifier
    n = replica_devices(cfg)
    cuda = cfg.target.device == "cuda"
    need_gpu = n * (vc.num_gpus_per_stage or 1) if cuda else 0
    need_cpu = n * vc.num_cpus + (vc.num_cpus if vc.pipeline_parallel_size > 1 else 0)
    alive = [x.get("Resources", {}) for x in nodes if x.get("Alive", True)]
    if cuda and not any(r.get("GPU", 0) for r in alive):
        return None
    if any(r.get("GPU", 0) >= need_gpu and r.get("CPU", 0) >= need_cpu for r in alive):
        return None
    have = ", ".join(f"{r.get('GPU', 0):g} GPU / {r.get('CPU', 0):g} CPU" for r in alive) or "none"
    return (f"verifier.tensor_parallel_size {vc.tensor_parallel_size} x pipeline_parallel_size "
            f"{vc.pipeline_parallel_size}: one replica needs {need_gpu:g} GPU(s) and {need_cpu:g} CPU(s) on one node "
            f"(STRICT_PACK), and no node has them (nodes: {have})")


def rank_memory(shape: Shape, tp: int, rows: int, logit_rows: int, dtype_bytes: int, first: int = 0,
                last: int | None = None) -> tuple[int, int, int]:
    """One rank's weights, activations and KV bytes per token for layers ``[first, last)``: the busiest rank's
    shard (:meth:`Shape.per_rank`), plus on rank 0 the gathered logits and everywhere the all-gather's parts."""
    mine = shape.per_rank(tp)
    last = shape.num_layers if last is None else last
    weights = mine.weight_bytes(dtype_bytes, first, last)
    act = activation_bytes(mine, rows, logit_rows, dtype_bytes)
    if tp > 1:
        act += logit_rows * shape.vocab_size * dtype_bytes + rows * shape.hidden_size * (tp * dtype_bytes + 4)
    return weights, act, mine.kv_bytes_per_token(dtype_bytes, last - first)


# -- placement -------------------------------------------------------------------------------
def rank_resources(device: str, cpus: float, gpus: float) -> dict:
    gpus = gpus or (1.0 if device == "cuda" else 0.0)
    return {k: float(v) for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}


def tp_bundles(tp: int, pp: int, device: str = "cpu", cpus_per_rank: float = 1.0, gpus_per_rank: float = 0.0,
               replica_cpus: float = 1.0) -> list[dict]:
    """The replica's placement group bundles (see the module's docstring)."""
    rank = rank_resources(device, cpus_per_rank, gpus_per_rank)
    if pp == 1:
        first = dict(rank)
        first["CPU"] = max(float(replica_cpus), rank.get("CPU", 0.0))
        return [first] + [dict(rank) for _ in range(tp - 1)]
    return [{"CPU": float(replica_cpus)}] + [dict(rank) for _ in range(tp * pp)]


def deployment_options(cfg: AppConfig) -> dict:
    """What the Verifier deployment's options become with tensor_parallel_size > 1."""
    vc = cfg.verifier
    return {"placement_group_bundles": tp_bundles(vc.tensor_parallel_size, vc.pipeline_parallel_size,
                                                  cfg.target.device, vc.num_cpus, vc.num_gpus_per_stage,
                                                  vc.num_cpus),
            "placement_group_strategy": "STRICT_PACK",
            # one stage: the replica is rank 0 and holds its device; with stages it holds nothing (bundle 0: CPU)
            "ray_actor_options": ({"num_cpus": vc.num_cpus, **({"num_gpus": vc.num_gpus_per_stage or 1.0}
                                                              if cfg.target.device == "cuda" else {})}
                                  if vc.pipeline_parallel_size == 1 else {"num_cpus": 0})}


class TPWorker:
    """A tensor-parallel rank > 0 (a Ray actor): :meth:`run` serves rank 0's commands until the group ends; a
    failure exits the process (the actor is dead, rank 0 starts a new one)."""

    def run(self, addr: str, port: int, rank: int, world: int, spec: ShardSpec) -> None:
        serve_rank(addr, port, rank, world, spec)


class RayLauncher:
    """Ranks 1..N-1 as :class:`TPWorker` actors, each in its bundle of the replica's placement group (no restarts
    by Ray: rank 0 restarts the whole group)."""

    def __init__(self, pg, bundles: list[int], resources: dict):
        self.pg, self.bundles, self.resources = pg, bundles, resources
        self.actors, self.refs = [], []

    def address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(self, addr: str, port: int, world: int, spec: ShardSpec) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(TPWorker)
        self.actors, self.refs = [], []
        for rank in range(1, world):
            opts = {"num_cpus": self.resources.get("CPU", 0.0), "num_gpus": self.resources.get("GPU", 0.0),
                    "max_restarts": 0, "max_task_retries": 0}
            if self.pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=self.bundles[rank - 1])
            a = cls.options(**opts).remote()
            self.actors.append(a)
            self.refs.append(a.run.remote(addr, port, rank, world, spec))

    def failed(self) -> str | None:
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - reported as the group's start error
                return f"a worker actor failed: {str(e).splitlines()[0][:300]}"
        return None

    def stop(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors, self.refs = [], []


def tp_runner(model_cfg: ModelConfig, tp: int, *, first: int = 0, last: int | None = None, pg=None,
              bundles: list[int] | None = None, cpus_per_rank: float = 1.0, gpus_per_rank: float = 0.0,
              torch_threads: int | None = None, kv_capacity_tokens: int = 1 << 16, compile: bool = False,
              prefix_caching: bool = False, timeout_s: float = 120.0) -> TPRunner:
    """Rank 0 here, ranks 1..tp-1 as actors in ``bundles`` of ``pg`` (the current placement group by default)."""
    import functools

    import ray

    from specdec.model.loading import resolve_device

    problems = split_problems(model_cfg, tp)
    if problems:
        raise ValueError(f"{model_cfg.model}: " + "; ".join(problems))
    if pg is None:
        pg = ray.util.get_current_placement_group()
    if bundles is None:
        bundles = list(range(1, tp))
    res = rank_resources(model_cfg.device, cpus_per_rank, gpus_per_rank)
    threads = torch_threads or max(1, int(res.get("CPU", 1)))
    spec = ShardSpec(functools.partial(_load_slice, model_cfg, first, last), first, last, kv_capacity_tokens,
                     prefix_caching, compile, threads, timeout_s, load_shard=True,
                     device=resolve_device(model_cfg.device))
    return TPRunner(spec, tp, RayLauncher(pg, bundles, res))  # .loaded: the target's metadata


def _load_slice(model_cfg: ModelConfig, first: int, last: int | None, rank: int, tp: int):
    """Rank ``rank``'s weights of layers ``[first, last)``: of a safetensors checkpoint only its part is read
    (a 70B target never whole in one rank's memory); other sources are read whole and the rank keeps its part."""
    from deploy.verifier.pipeline_stage import load_stage, target_config

    n = target_config(model_cfg).num_hidden_layers
    return load_stage(model_cfg, first, n if last is None else last, with_tokenizer=first == 0 and rank == 0,
                      shard=(rank, tp))
