"""The prompt pool and the target's own continuations the simulated users draft from.

A cheap local copy of the target (same model spec, same seed, same dtype as the app)
decodes every prompt of the pool greedily once, before the test, in the runner process
(no gevent, no Ray). The Locust users then hold only token lists: they draft from these
continuations with per-node corruption (:mod:`loadtests.synthetic_tree`), and because the
server's output is lossless (DESIGN: greedy gives exactly the target's tokens), they can
also check every verified token against them, which turns the load test into a
losslessness check under load. Prompts are random token ids (the tiny target has no
tokenizer), deterministic in ``workload.seed``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from loadtests.config import DEVICE_DRAFT_MS, LoadTestConfig


def make_prompts(cfg: LoadTestConfig, vocab: int) -> list[list[int]]:
    w = cfg.workload
    rng = random.Random(w.seed)
    lo, hi = w.prompt_len
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(w.prompts)]


def build_workload(cfg: LoadTestConfig) -> dict:
    """Prompts, greedy continuations and model facts, as a JSON-able dict for the users."""
    import torch

    from specdec.model.loading import load_target
    from specdec.reference import reference_decode
    from specdec.sampling import SamplingParams

    t0 = time.perf_counter()
    t = cfg.app_config().target
    torch.set_num_threads(1)
    loaded = load_target(t, device="cpu")
    prompts = make_prompts(cfg, loaded.vocab_size)
    params = SamplingParams(max_tokens=cfg.user.max_tokens)
    truths = [reference_decode(loaded.model, p, params, loaded.eos_token_ids) for p in prompts]
    return {"target": cfg.target, "model": loaded.name, "vocab_size": loaded.vocab_size,
            "eos_token_ids": list(loaded.eos_token_ids), "prompts": prompts, "truths": truths,
            "seconds": time.perf_counter() - t0}


def write_user_config(cfg: LoadTestConfig, workload: dict, path: Path) -> None:
    """Everything a Locust process needs, in one JSON file (no imports of deploy/torch there)."""
    vc = cfg.app_config().verifier
    data = {"name": cfg.name, "user": cfg.user.model_dump(mode="json"), "keys": cfg.tenant_keys(),
            "shares": cfg.user_shares(), "workload": workload, "max_tree_nodes": vc.max_tree_nodes,
            "max_tree_depth": vc.max_tree_depth, "device_draft_ms": DEVICE_DRAFT_MS}
    path.write_text(json.dumps(data))
