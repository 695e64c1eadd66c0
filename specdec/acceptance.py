"""The server's acceptance rules: which draft nodes the target keeps, and the bonus token.
Tree walk (SpecInfer/SpecExec), chain (Leviathan et al. 2023; DSSD §3 / PicoSpec §3.3) and tree rejection sampling
(SpecInfer §4.2 / SpecTr, Sequoia §3.2); each emitted token follows the target's distribution (docs/acceptance.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.proposal import Proposal
from specdec.residual import Rejection
from specdec.sampling import SamplingParams, greedy_token, sample_from_probs, sample_token, target_probs
from specdec.tree import DraftTree

EXHAUST_P = 1e-3  # target probability that a rejection's tail candidates run out (one more round trip)


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
    penalties=None,  # Penalties of the session's history (specdec/penalties.py), or None
    argmax: list[int] | None = None,  # [n + 1] each row's greedy token, found for the whole batch at once
) -> TreeAcceptance:
    """Walk ``tree`` by sampling the target at each visited node; ``max_emit`` caps emitted tokens (accepted +
    bonus), and a sampled stop token ends the walk as the bonus token (docs/specdec.md)."""
    accepted: list[int] = []
    pos = 0  # forward row of the current node (0 = root)
    while True:  # only visited rows are read
        if params.greedy and penalties is None and argmax is not None:
            tok = argmax[pos]
        else:
            row = logits[pos] if penalties is None else penalties.apply(logits[pos], [tree.tokens[a] for a in accepted])
            tok = greedy_token(row) if params.greedy else sample_token(row, params, generator)
        if tok in stop_ids or (max_emit is not None and len(accepted) + 1 >= max_emit):
            return TreeAcceptance(tuple(accepted), tok)
        nxt = next((c for c in tree.children[pos] if tree.tokens[c] == tok), None)
        if nxt is None:
            return TreeAcceptance(tuple(accepted), tok)
        accepted.append(nxt)
        pos = nxt + 1


# -- chain rejection sampling: the server half ----------------------------------------------
@dataclass(frozen=True)
class ChainAcceptance:
    num_accepted: int
    bonus: int | None  # server-sampled when all k are accepted (greedy: also on a miss); None = edge resamples
    rejection: Rejection | None = None  # on rejection: p at the rejected position, for the edge
    tail: torch.Tensor | None = None  # [vocab] p with the head zeroed: kept to draw more candidates


def draw(probs: torch.Tensor, n: int, generator: torch.Generator | None) -> list[int]:
    """``n`` i.i.d. samples of ``probs`` ([vocab], unnormalised), one uniform each (inverse CDF)."""
    cdf = torch.cumsum(probs.double(), dim=0)  # [vocab]
    u = torch.rand(n, generator=generator, dtype=torch.float64) * cdf[-1]  # [n]
    idx = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[0] - 1).tolist()
    for j, i in enumerate(idx):
        while probs[i] <= 0 and i > 0:  # never a zero-probability token at a rounding boundary
            i -= 1
        idx[j] = i
    return idx


def sparse_rejection(
    p: torch.Tensor,  # [vocab] float32 on the CPU: the processed target distribution
    gap: float,  # q(x) - p(x) of the rejected token: a lower bound on TV(p, q); <= 0 if unknown
    max_entries: int,
    generator: torch.Generator | None,
) -> tuple[Rejection, torch.Tensor | None]:
    """The downlink of a rejection, and p's tail to keep (None when all of p was sent): all of p if it fits
    ``max_entries``, else a head and tail candidates that run out w.p. <= ``EXHAUST_P`` (docs/specdec.md)."""
    vals, ids = torch.sort(p, descending=True)
    support = int((vals > 0).sum())
    if support <= max_entries:  # all of p fits: the edge computes the residual outright
        return Rejection(tuple(ids[:support].tolist()), tuple(vals[:support].tolist())), None
    tails = torch.flip(torch.cumsum(torch.flip(vals[:support].double(), [0]), 0), [0])[: max_entries + 1]  # t_n
    if gap > 0:
        # (t / (t + gap))^m <= EXHAUST_P  <=>  m >= -log(EXHAUST_P) / log1p(gap / t)   [K + 1]
        need = torch.ceil(-math.log(EXHAUST_P) / torch.log1p(gap / tails).clamp(min=1e-300))
        m = need.clamp(1, max_entries)
        cost = torch.arange(max_entries + 1, dtype=torch.float64) + m
        if bool((need <= max_entries).any()):  # heads with which the bound can be met: the cheapest of them
            cost = cost.masked_fill(need > max_entries, float("inf"))
        n = int(max_entries - torch.argmin(torch.flip(cost, [0])))  # the largest head on ties
        m_n = int(m[n])
    else:  # nothing known about TV(p, q): the largest head and as many candidates
        n, m_n = max_entries, max_entries
    tail = p.clone()
    tail[ids[:n]] = 0.0
    ys = draw(tail, m_n, generator)
    return Rejection(tuple(ids[:n].tolist()), tuple(vals[:n].tolist()), float(tail.double().sum()),
                     tuple(ys), tuple(float(tail[y]) for y in ys)), tail


def more_candidates(tail: torch.Tensor, n: int, generator: torch.Generator | None) -> Rejection:
    """A refill: ``n`` fresh tail candidates of the same rejection (no head: the edge has it)."""
    ys = draw(tail, n, generator)
    return Rejection((), (), float(tail.double().sum()), tuple(ys), tuple(float(tail[y]) for y in ys))


def rejection_sample_chain(
    draft_tokens: list[int],
    draft_q: list[float],  # q(x_i) the edge's draft gave its own token, one per draft token
    logits: torch.Tensor,  # [k + 1, vocab]: row i predicts draft token i; row k the bonus
    params: SamplingParams,
    generator: torch.Generator | None,
    max_entries: int = 64,
    penalties=None,  # Penalties of the session's history: row i is penalised after draft_tokens[:i]
) -> ChainAcceptance:
    """Server half of DSSD-split rejection sampling (q >= p: accept w.p. p/q)."""
    if penalties is not None:
        logits = torch.stack([penalties.apply(logits[i], draft_tokens[:i]) for i in range(len(draft_tokens) + 1)])
    for i, (x, q) in enumerate(zip(draft_tokens, draft_q)):
        if params.greedy:  # greedy target = point mass: the argmax is the correction itself
            best = greedy_token(logits[i])
            if best == x:
                continue
            return ChainAcceptance(i, best)
        p = target_probs(logits[i], params)  # [vocab]
        px = float(p[x])
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if q > 0 and u < min(1.0, px / q):
            continue
        rej, tail = sparse_rejection(p.cpu(), q - px, max_entries, generator)
        return ChainAcceptance(i, None, rej, tail)
    bonus = sample_token(logits[len(draft_tokens)], params, generator)
    return ChainAcceptance(len(draft_tokens), bonus)


# -- tree rejection sampling: multi-draft, siblings drawn without replacement ---------------------
def multi_draft_step(
    p: torch.Tensor,  # [vocab] float64: the processed target distribution at the node
    q: torch.Tensor,  # [vocab] float64: the proposal its children were drawn from (normalised)
    children: list[int],  # the children's tokens, in the order they were drawn
    generator: torch.Generator | None,
) -> tuple[int | None, int]:
    """One node of the multi-draft rule (docs/acceptance.md): (accepted child index or None, emitted token)."""
    r, q = p.clone(), q.clone()
    for i, c in enumerate(children):
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if u * float(q[c]) < float(r[c]):  # u < min(1, r(c) / q(c)), q(c) > 0
            return i, c
        nxt = torch.clamp(r - q, min=0.0)  # rejected: r(c) < q(c), so nxt sums to TV(r, q) > 0
        z = float(nxt.sum())
        if z > 1e-12:
            r = nxt / z
        else:  # r == q up to rounding: the rejection had probability ~0; drop c and go on with r
            r[c] = 0.0
            r = r / r.sum()
        q[c] = 0.0  # without replacement: the next child was drawn from q without c
        zq = float(q.sum())
        if zq <= 0.0:
            break
        q = q / zq
    return None, sample_from_probs(r, generator)


def rejection_walk_tree(
    tree: DraftTree,
    logits: torch.Tensor,  # [n + 1, vocab]: row 0 = root, row i + 1 = node i
    proposals: tuple[Proposal | None, ...],  # per position (root, then node i): see check_proposals
    params: SamplingParams,
    generator: torch.Generator | None,
    max_emit: int | None = None,
    stop_ids: frozenset[int] = frozenset(),
    penalties=None,
) -> TreeAcceptance:
    """Walk a tree of sampled siblings by multi-draft rejection sampling; arguments as :func:`walk_tree`."""
    if params.greedy:
        return walk_tree(tree, logits, params, generator, max_emit, stop_ids, penalties)
    accepted: list[int] = []
    pos = 0
    while True:
        kids = tree.children[pos]
        row = logits[pos] if penalties is None else penalties.apply(logits[pos], [tree.tokens[a] for a in accepted])
        p = target_probs(row, params).double().cpu()  # [vocab]
        if kids:
            i, tok = multi_draft_step(p, proposals[pos].dense(p.shape[0]), [tree.tokens[c] for c in kids], generator)
        else:
            i, tok = None, sample_from_probs(p, generator)
        if tok in stop_ids or (max_emit is not None and len(accepted) + 1 >= max_emit) or i is None:
            return TreeAcceptance(tuple(accepted), tok)
        accepted.append(kids[i])
        pos = kids[i] + 1
