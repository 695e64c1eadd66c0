"""Target-only autoregressive decoding: the ground truth the lossless tests compare to. Independent of the engine
(HF forward) but with the same sampler, so a seeded run follows the same sample path (docs/specdec.md)."""

from __future__ import annotations

import torch

from specdec.penalties import penalties_for
from specdec.sampling import SamplingParams, make_generator, sample_token
from specdec.tree import DraftTree


@torch.inference_mode()
def reference_decode(model, prompt: list[int], params: SamplingParams, eos_token_ids=(), grammar=None) -> list[int]:
    """Generated tokens (the stop token included, as the engine emits it); ``grammar``: a fresh
    :class:`specdec.grammar.GrammarState` each row is masked by (constrained decoding)."""
    from transformers import DynamicCache

    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    device = next(model.parameters()).device
    g = make_generator(params)
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, L]
    out: list[int] = []
    max_len = getattr(model.config, "max_position_embeddings", 1 << 16)
    while True:
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]  # [vocab]
        if grammar is not None:
            logits = grammar.apply(logits[None], DraftTree.empty())[0]
        pen = penalties_for(params, prompt, out, logits.shape[-1], logits.device)  # the history so far
        tok = sample_token(logits.float() if pen is None else pen.apply(logits), params, g)
        out.append(tok)
        if grammar is not None:
            grammar.accept([tok])
        if tok in stop or len(out) >= params.max_tokens or len(prompt) + len(out) >= max_len - 1:
            return out
        ids = torch.tensor([[tok]], dtype=torch.long, device=device)
