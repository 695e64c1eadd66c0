"""Shared pieces of the edge-agent tests: one generation through an agent over LocalTransport
(:func:`run_agent`, with the prompt and greedy parameters the agent tests share), a
partially-agreeing draft for the tiny target, and for the distribution tests many seeded sampled
generations through the agent and the target's exact distribution of its next tokens (with its
marginals)."""

from __future__ import annotations

import asyncio
import copy
import itertools

import torch

from specdec.sampling import SamplingParams

EOS = [2]
PROMPT = [1, 5, 9, 33, 7, 100, 200, 33, 7]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def run_agent(engine, drafter, params, prompt=PROMPT, rtt_ms=0.0, before_verify=None, **cfg):
    """One generation by an agent on ``LocalTransport(engine)`` configured with ``cfg``: (result, transport)."""
    from edge_agent.agent import AgentConfig, EdgeAgent
    from edge_agent.transport import LocalTransport

    transport = LocalTransport(engine, rtt_ms=rtt_ms, before_verify=before_verify)
    agent = EdgeAgent(transport, drafter, config=AgentConfig(**cfg))
    try:
        return asyncio.run(agent.generate(prompt, params)), transport
    finally:
        agent.close()


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
    from edge_agent.agent import EdgeAgent
    from edge_agent.draft_backends import ModelDrafter
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


@torch.inference_mode()
def sequence_probs(model, prompt: list[int], params, length: int) -> dict[tuple[int, ...], float]:
    """The target's probability of every sequence of its next ``length`` tokens after ``prompt`` under
    ``params`` (a tiny vocabulary: V^length sequences), from one batched forward per position."""
    from specdec.sampling import target_probs

    v = model.config.vocab_size
    rows: dict[tuple[int, ...], list[float]] = {}
    for d in range(length):
        ctxs = list(itertools.product(range(v), repeat=d))
        probs = target_probs(model(torch.tensor([prompt + list(c) for c in ctxs])).logits[:, -1], params)  # [V^d, V]
        rows.update(zip(ctxs, probs.tolist()))
    joint = {(): 1.0}
    for _ in range(length):
        joint = {seq + (x,): p * q for seq, p in joint.items() for x, q in enumerate(rows[seq])}
    return joint


def marginal(joint: dict[tuple[int, ...], float], lo: int, hi: int) -> dict[tuple[int, ...], float]:
    """The distribution of tokens ``lo..hi-1`` of the sequences of ``joint``."""
    out: dict[tuple[int, ...], float] = {}
    for seq, p in joint.items():
        out[seq[lo:hi]] = out.get(seq[lo:hi], 0.0) + p
    return out
