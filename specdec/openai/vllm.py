"""vLLM's own endpoints beside the OpenAI API: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``."""

from __future__ import annotations

from specdec.errors import InvalidRequest
from specdec.openai.request import chat_prompt, chat_template_kwargs, optional, token_ids
from specdec.version import package_version


def tokenize(body: dict, tokenizer, max_model_len: int) -> dict:
    """vLLM's ``POST /tokenize``: a ``prompt`` (text) or chat ``messages`` -> ``count``, ``tokens``,
    ``max_model_len`` (and ``token_strs`` when asked)."""
    if tokenizer is None:
        raise InvalidRequest("this deployment's target has no tokenizer")
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("send a 'prompt' (text) or chat 'messages'")
    if "messages" in body:
        kwargs = {**chat_template_kwargs(body.get("chat_template_kwargs")),
                  "add_generation_prompt": optional(body, "add_generation_prompt", bool, True)}
        ids = chat_prompt(body["messages"], tokenizer, kwargs)
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequest("'prompt' must be a string", param="prompt")
        ids = tokenizer(prompt, add_special_tokens=optional(body, "add_special_tokens", bool, True))["input_ids"]
    out = {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids), "token_strs": None}
    if optional(body, "return_token_strs", bool, False):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(list(ids))
    return out


def detokenize(body: dict, tokenizer, vocab_size: int) -> dict:
    """vLLM's ``POST /detokenize``: ``tokens`` -> ``prompt`` (the text)."""
    if tokenizer is None:
        raise InvalidRequest("this deployment's target has no tokenizer")
    ids = token_ids(body.get("tokens") if isinstance(body, dict) else None, "tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token ids {bad[:4]} are outside the vocabulary [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(ids)}


def server_version() -> dict:
    """vLLM's ``GET /version``: this package's version."""
    return {"version": package_version()}
