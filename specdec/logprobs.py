"""The target's log-probabilities of emitted tokens (OpenAI ``logprobs`` / ``top_logprobs``), as vLLM
reports them: log-softmax of the raw logits, float32, before penalties and temperature/top-k/top-p. Pure torch."""

from __future__ import annotations

import torch

from specdec.protocol import TokenLogprob


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """rows: [m, vocab] logits, row i the position that emitted ``tokens[i]``; ``top``: alternatives each."""
    if not tokens:
        return ()
    lp = torch.log_softmax(rows[: len(tokens)].float(), dim=-1)  # [m, vocab]
    chosen = lp.gather(1, torch.as_tensor(tokens, device=lp.device).view(-1, 1))[:, 0].tolist()  # [m]
    if top > 0:
        vals, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)  # [m, top]
        vals, ids = vals.tolist(), ids.tolist()
    else:
        vals, ids = [[]] * len(tokens), [[]] * len(tokens)
    return tuple(TokenLogprob(t, c, tuple(i), tuple(v)) for t, c, i, v in zip(tokens, chosen, ids, vals))
