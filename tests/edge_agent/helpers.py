"""Shared pieces of the edge-agent tests: a partially-agreeing draft for the tiny target, and
many seeded sampled generations through the agent for the distribution tests."""

from __future__ import annotations

import asyncio
import copy

import torch


def noisy_copy(model, scale: float = 0.005, seed: int = 1, num_layers: int | None = None):
    """A copy of ``model`` with Gaussian noise on every weight (partial acceptance) and
    optionally only its first ``num_layers`` decoder layers."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    if num_layers is not None:
        draft.model.layers = draft.model.layers[:num_layers]
        draft.config.num_hidden_layers = num_layers
    return draft.eval()


@torch.inference_mode()
def hf_topk(model, context: list[int], k: int) -> tuple[list[int], list[float]]:
    """The draft's top-k next tokens after ``context`` by a plain HF forward (no tree KV)."""
    logits = model(input_ids=torch.tensor([context])).logits[0, -1]
    lp = torch.log_softmax(logits.float(), dim=-1)
    v, i = torch.topk(lp, k)
    return i.tolist(), v.tolist()


def sampled_generations(model, engine, config, prompt: list[int], n: int, length: int, rtt_ms: float = 0.0) -> list:
    """``n`` generations of ``length`` tokens at temperature 1 (seeds 0..n-1, EOS ignored) by one
    agent on ``LocalTransport(engine, rtt_ms=rtt_ms)`` drafting with a noisy copy of ``model``, under ``config``."""
    from deploy.verifier.sampling import SamplingParams
    from edge_agent.agent import EdgeAgent
    from edge_agent.drafter import ModelDrafter
    from edge_agent.transport import LocalTransport

    async def main():
        agent = EdgeAgent(LocalTransport(engine, rtt_ms=rtt_ms), ModelDrafter(noisy_copy(model, 0.3, seed=4)),
                           config=config)
        try:
            return [await agent.generate(prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=length,
                                                                ignore_eos=True)) for i in range(n)]
        finally:
            agent.close()

    return asyncio.run(main())
