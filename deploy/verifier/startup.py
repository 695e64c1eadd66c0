"""What a verifier replica does at start, without Serve: load the target (``target.model``), size
its KV pool from the memory it may use (:mod:`deploy.verifier.kv_sizing`) and build the engine.
:class:`deploy.verifier.server.VerifierServer` and ``benchmarks.full_size`` both run this."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deploy.config import AppConfig
from deploy.verifier.kv_sizing import KVPlan, cap_plan, sized_runner
from specdec.engine import OpenRequest, VerifierEngine, VerifyRequest
from specdec.model.loading import LoadedModel, load_target
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, TreeLimits

WARMUP_PROMPT_TOKENS = 32
WARMUP_TREE_NODES = 4

log = logging.getLogger("ray.serve")


@dataclass
class ReplicaTarget:
    loaded: LoadedModel
    engine: VerifierEngine
    kv_plan: KVPlan


def start_target(config: AppConfig, on_forward=None, runner=None, loaded: LoadedModel | None = None) -> ReplicaTarget:
    """The replica's target and engine. ``runner``: a pipeline's (stages sized by the cap), else the target
    is loaded here and its pool sized from memory; raises :class:`DoesNotFit` when it cannot hold one session."""
    vc, t = config.verifier, config.target
    loaded = loaded or load_target(t, weights_only=True)
    if runner is None:
        runner, plan = sized_runner(loaded, vc, t.max_model_len)
    else:
        plan = cap_plan(loaded, vc, t.max_model_len)
    log.info("%s: %s", loaded.name, plan.describe())
    engine = VerifierEngine(
        loaded.model, eos_token_ids=loaded.eos_token_ids, limits=TreeLimits(vc.max_tree_nodes, vc.max_tree_depth),
        max_model_len=t.max_model_len, runner=runner, chain_top_k=vc.chain_top_k, on_forward=on_forward,
        kv_capacity_tokens=plan.capacity_tokens, max_batch_tokens=vc.max_batch_tokens, compile=vc.compile,
        prefix_caching=vc.prefix_caching)
    return ReplicaTarget(loaded, engine, plan)


def warm_up(engine: VerifierEngine, vocab_size: int) -> None:
    """Dummy prefill and verify forwards, leaving nothing behind: first-forward costs paid before ready (issue 67)."""
    n = max(1, min(WARMUP_PROMPT_TOKENS, engine.max_model_len // 4))
    ids = [t for t in range(vocab_size - 1, -1, -1) if t not in engine.eos_token_ids][:n + WARMUP_TREE_NODES]
    counts = list(engine.prefix_tokens)
    sid = "warmup"
    try:
        opened = engine.open([OpenRequest(sid, ids[:n], SamplingParams(max_tokens=WARMUP_TREE_NODES + 2))])[0]
        if not isinstance(opened, Exception) and not opened.finished:
            engine.verify([VerifyRequest(sid, DraftTree.chain(ids[n:]), opened.prefix_len)])
    finally:
        engine.close(sid, cache=False)
        engine.prefix_tokens[:] = counts
