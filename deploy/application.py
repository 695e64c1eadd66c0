"""The Serve application: ``serve run deploy.app`` / ``serve run deploy/config.yaml``.

``build_app(args)``: the router bound to the verifier deployment (``topology: split``), or alone (``colocated``)."""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig

from deploy.config import AppConfig
from deploy.router.affinity import SessionAffinityRouter
from deploy.router.ingress import Router
from deploy.verifier.deployment import Verifier


def verifier_options(cfg: AppConfig) -> dict:
    vc = cfg.verifier
    opts = dict(
        num_replicas=vc.num_replicas,
        max_ongoing_requests=vc.max_ongoing_requests,
        ray_actor_options={"num_cpus": vc.num_cpus,
                           "num_gpus": vc.num_gpus_per_stage if vc.pipeline_parallel_size == 1 else 0},
        request_router_config=RequestRouterConfig(
            request_router_class=SessionAffinityRouter, request_routing_stats_period_s=1.0,
            request_router_kwargs={"version_margin": vc.version_affinity_margin,
                                   "prefix_margin": vc.prefix_affinity_margin}),
        health_check_period_s=10,
        graceful_shutdown_timeout_s=5,
    )
    if vc.max_replicas_per_node is not None:  # one stage (AppConfig refuses it with pipeline stages)
        opts["max_replicas_per_node"] = vc.max_replicas_per_node
    if vc.tensor_parallel_size > 1:  # ranks (and stages) in one STRICT_PACK group: deploy/verifier/tensor_parallel.py
        from deploy.verifier.tensor_parallel import deployment_options, placement_problem

        opts.update(deployment_options(cfg))
        import ray

        problem = placement_problem(cfg, ray.nodes()) if ray.is_initialized() else None
        if problem:
            raise ValueError(problem)
        return opts
    if vc.pipeline_parallel_size > 1:
        from deploy.verifier.pipeline import pipeline_bundles

        opts["placement_group_bundles"] = pipeline_bundles(
            vc.pipeline_parallel_size, device=cfg.target.device, cpus_per_stage=vc.num_cpus,
            gpus_per_stage=vc.num_gpus_per_stage)
        opts["placement_group_strategy"] = "PACK"
        opts["ray_actor_options"] = {"num_cpus": 0}
    return opts


def versions_user_config(cfg: AppConfig) -> dict:
    """The deployments' ``user_config``: the target versions; a Serve config overriding it adds or removes
    versions through ``reconfigure``, without restarting a replica (FlexSpec §III-B)."""
    return {"adapters": dict(cfg.target.adapters), "max_loaded_adapters": cfg.target.max_loaded_adapters}


def build_app(args: dict | None = None):
    cfg = AppConfig(**(args or {}))
    data = cfg.model_dump(mode="json")
    logging = {"enable_access_log": cfg.access_log}
    versions = versions_user_config(cfg)
    router = dict(
        logging_config=logging,
        user_config=versions,
        num_replicas=cfg.router.num_replicas,
        max_queued_requests=cfg.router.max_queued_requests,
        max_ongoing_requests=max(cfg.router.max_ongoing_requests, cfg.router.max_pending_verifies + 64),
        ray_actor_options={"num_cpus": 0},
    )
    if cfg.topology == "colocated":  # the router replica holds the verifier: the verifier's resources
        vopts = verifier_options(cfg)
        router.update({k: vopts[k] for k in ("ray_actor_options", "health_check_period_s",
                                             "graceful_shutdown_timeout_s")})
        return Router.options(**router).bind(None, data)
    verifier = Verifier.options(**verifier_options(cfg), logging_config=logging, user_config=versions).bind(data)
    return Router.options(**router).bind(verifier, data)


def verifier_deployment(cfg: AppConfig) -> str:
    """The name of the deployment whose replicas hold the verifier (sessions, KV, forwards)."""
    return "Router" if cfg.topology == "colocated" else "Verifier"
