"""Acceptance rules: which draft nodes the target keeps, and the bonus token.

Tree walk by target sampling (DESIGN.md step 4; SpecInfer/SpecExec-style "sample, then
match"): at the root sample the target's next token; if a child of the current node
carries that token, accept the child and continue from it; otherwise the sample is the
bonus token and the round ends. Every emitted token is a sample of the target at its
own prefix, so the output is the target's (greedy: identical; sampling: same
distribution) for any tree and without draft probabilities.

Chain rejection sampling (Leviathan et al. 2023; split DSSD-style, dssd.txt §3): the
edge sends q(x_i) of each drafted token; the server accepts x_i with probability
min(1, p(x_i) / q(x_i)). On the first rejection it returns the target distribution at
that position (top-K sparse) and the edge samples the replacement from the residual
norm(max(0, p - q)) with its own full q. If all k are accepted the server samples the
bonus from p at position k + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deploy.verifier.sampling import SamplingParams, sample_from_probs, sample_token, target_probs
from deploy.verifier.tree import DraftTree


@dataclass(frozen=True)
class TreeAcceptance:
    accepted: tuple[int, ...]  # node indices of the accepted path, root's child first
    bonus: int  # the target's sample after the last accepted node


def walk_tree(
    tree: DraftTree,
    logits: torch.Tensor,  # [n + 1, vocab]: row 0 = root, row i + 1 = node i
    params: SamplingParams,
    generator: torch.Generator | None,
    max_emit: int | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> TreeAcceptance:
    """Walk ``tree`` by sampling the target at each visited node.

    ``max_emit`` caps emitted tokens (accepted + bonus), so a session never samples past
    its max_tokens and its generator stays in step with target-only decoding; a sampled
    stop token (EOS / stop id) ends the walk as the bonus token.
    """
    accepted: list[int] = []
    pos = 0  # forward row of the current node (0 = root)
    while True:  # only visited rows are read (argmax in float32: bf16 argmax is slow on CPU)
        row = logits[pos]
        tok = int(row.float().argmax()) if params.greedy else sample_token(row, params, generator)
        if tok in stop_ids or (max_emit is not None and len(accepted) + 1 >= max_emit):
            return TreeAcceptance(tuple(accepted), tok)
        nxt = next((c for c in tree.children[pos] if tree.tokens[c] == tok), None)
        if nxt is None:
            return TreeAcceptance(tuple(accepted), tok)
        accepted.append(nxt)
        pos = nxt + 1


@dataclass(frozen=True)
class ChainAcceptance:
    num_accepted: int
    bonus: int | None  # server-sampled when all k are accepted (greedy: also on a miss); None = edge resamples
    # on rejection: the target distribution at the rejected position, top-K sparse
    reject_top_ids: torch.Tensor | None = None  # [K] long
    reject_top_probs: torch.Tensor | None = None  # [K] float32


def rejection_sample_chain(
    draft_tokens: list[int],
    draft_q: list[float],  # q(x_i) the edge's draft gave its own token, one per draft token
    logits: torch.Tensor,  # [k + 1, vocab]: row i predicts draft token i; row k the bonus
    params: SamplingParams,
    generator: torch.Generator | None,
    top_k_return: int = 64,
) -> ChainAcceptance:
    """Server half of DSSD-split rejection sampling (q >= p: accept w.p. p/q)."""
    for i, (x, q) in enumerate(zip(draft_tokens, draft_q)):
        if params.greedy:  # greedy target = point mass: the argmax is the correction itself
            best = int(torch.argmax(logits[i]))
            if best == x:
                continue
            return ChainAcceptance(i, best)
        p = target_probs(logits[i], params)  # [vocab]
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if q > 0 and u < min(1.0, float(p[x]) / q):
            continue
        k = min(top_k_return, p.shape[0])
        probs, ids = torch.topk(p, k)
        return ChainAcceptance(i, None, ids, probs)
    bonus = sample_token(logits[len(draft_tokens)], params, generator)
    return ChainAcceptance(len(draft_tokens), bonus)


def residual_sample(
    reject_top_ids: torch.Tensor,  # [K] long
    reject_top_probs: torch.Tensor,  # [K] float
    draft_probs: torch.Tensor,  # [vocab] the edge's full q at the rejected position
    generator: torch.Generator | None,
) -> int:
    """Edge half: sample from norm(max(0, p - q)). Exact when p's support is in the top-K."""
    p = torch.zeros_like(draft_probs, dtype=torch.float64)
    p[reject_top_ids] = reject_top_probs.double()
    residual = torch.clamp(p - draft_probs.double(), min=0.0)
    if residual.sum() <= 0:  # p == q numerically: any sample of p is exact
        residual = p
    return sample_from_probs(residual, generator)
