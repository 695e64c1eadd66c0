"""OpenAI-compatible request parsing and response shaping (server-only modes).

Clients without a draft model use ``/v1/completions`` and ``/v1/chat/completions``;
the router then decodes on the server, either plain autoregressive (an empty tree per
round: one target step, batched with everyone else's verifies) or server-side
speculative decoding (a drafter in the router builds the trees). Pure module.
"""

from __future__ import annotations

import json
import time
import uuid

from deploy.errors import InvalidRequest

MODES = ("ar", "sd")


def parse_completion(body: dict, tokenizer, chat: bool) -> tuple[list[int], dict, bool, str]:
    """-> prompt ids, sampling dict, stream flag, mode."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "content" in m for m in msgs):
            raise InvalidRequest("'messages' must be a non-empty list of {role, content}")
        if tokenizer is None:
            raise InvalidRequest("this deployment's target has no tokenizer; use /v1/sessions with token ids")
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        elif isinstance(prompt, str) and prompt:
            if tokenizer is None:
                raise InvalidRequest("this deployment's target has no tokenizer: send 'prompt' as token ids")
            ids = tokenizer(prompt)["input_ids"]
        else:
            raise InvalidRequest("'prompt' must be a non-empty string or a list of token ids")
    stop_ids = body.get("stop_token_ids") or []
    sampling = {
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],  # OpenAI's default
        "top_p": body.get("top_p", 1.0), "top_k": body.get("top_k", 0) or 0,
        "max_tokens": body.get("max_tokens", body.get("max_completion_tokens", 128)) or 128,
        "seed": body.get("seed"), "stop_token_ids": stop_ids, "ignore_eos": bool(body.get("ignore_eos", False)),
    }
    mode = body.get("mode", "ar")
    if mode not in MODES:
        raise InvalidRequest(f"'mode' must be one of {MODES}")
    if int(body.get("n", 1) or 1) != 1:
        raise InvalidRequest("only n=1 is supported")
    return list(ids), sampling, bool(body.get("stream", False)), mode


def completion_response(model: str, text: str, ids: list[int], prompt_len: int, finish: str | None,
                        chat: bool, stats: dict) -> dict:
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    choice = {"index": 0, "finish_reason": finish or "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(ids),
                      "total_tokens": prompt_len + len(ids)},
            "specedge": stats}


def stream_chunk(cid: str, model: str, delta: str, finish: str | None, chat: bool) -> str:
    choice = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": delta} if delta else {}
    else:
        choice["text"] = delta
    obj = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": [choice]}
    return f"data: {json.dumps(obj)}\n\n"
