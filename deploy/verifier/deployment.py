"""The ``Verifier`` Serve deployment: a thin binding of :class:`deploy.verifier.server.VerifierServer`.

Serve's hooks map onto the core; the only verifier module that imports Ray Serve (as Ray Serve LLM does)."""

from __future__ import annotations

from ray import serve

from deploy import gc_policy
from deploy.config import AppConfig
from deploy.verifier.server import VerifierServer
from deploy.verifier.kv_sizing import Sizing


class VerifierDeployment(VerifierServer):
    """A Serve replica's VerifierServer (in the router's replica if ``colocated``); its tag prefixes session ids."""

    def __init__(self, config: dict):
        cfg = AppConfig(**config)
        tag = serve.get_replica_context().replica_id.unique_id
        runner = loaded = None
        vc = cfg.verifier
        if vc.tensor_parallel_size > 1 and vc.pipeline_parallel_size == 1:  # rank 0 here, the others actors
            from deploy.verifier.tensor_parallel import tp_runner

            runner = tp_runner(cfg.target, vc.tensor_parallel_size, cpus_per_rank=vc.num_cpus,
                               gpus_per_rank=vc.num_gpus_per_stage, torch_threads=vc.torch_threads,
                               kv_capacity_tokens=vc.kv_pool_tokens(), compile=vc.compile,
                               prefix_caching=vc.prefix_caching)
            loaded = runner.loaded
        elif vc.pipeline_parallel_size > 1:  # stages load their own layer slices; the replica holds no weights
            from deploy.verifier.pipeline import build_runner

            runner = build_runner(cfg.target, vc.pipeline_parallel_size, cpus_per_stage=vc.num_cpus,
                                  gpus_per_stage=vc.num_gpus_per_stage or None, torch_threads=vc.torch_threads,
                                  kv_capacity_tokens=vc.kv_pool_tokens(), compile=vc.compile,
                                  early_exit=vc.early_exit,  # each stage builds the heads of its exit layers
                                  prefix_caching=vc.prefix_caching, tensor_parallel_size=vc.tensor_parallel_size,
                                  sizing=Sizing.of(vc, cfg.target.max_model_len))  # each stage checks its pool fits
            loaded = runner.loaded
        super().__init__(cfg, replica_tag=tag, runner=runner, loaded=loaded)
        gc_policy.settle(cfg.gc_gen0_threshold)  # the weights, tokenizer and Ray's state: frozen

    def record_routing_stats(self) -> dict:
        return {"sessions": len(self.engine.sessions), "kv_tokens": self.engine.kv_tokens(),
                "pending": self.pending(), "adapters": self.versions.registry.held()}

    async def reconfigure(self, user_config: dict) -> None:
        """Serve's no-restart config update: the target versions (:meth:`VerifierServer.apply_user_config`)."""
        await self.apply_user_config(user_config)

    def check_health(self) -> None:
        if self.loop.task is not None and self.loop.task.done():
            raise RuntimeError("verify loop stopped")
        broken = getattr(self.engine.runner, "broken", None)  # a tensor-parallel group that could not restart
        if broken:
            raise RuntimeError(broken)

    async def info(self) -> dict:
        return self.model_info()

    async def get_stats(self, session_id: str | None = None) -> dict:
        """Replica statistics; ``session_id`` routes the call to that session's replica. ``tensor_parallel``: the
        group's size, restarts and worker process ids (None with one rank)."""
        return {**self.stats(), "tensor_parallel": getattr(self.engine.runner, "tp_stats", lambda: None)()}


Verifier = serve.deployment(name="Verifier")(VerifierDeployment)
