"""OpenAI-compatible request parsing and response shaping (server-only modes).

Clients without a draft model use ``/v1/completions`` and ``/v1/chat/completions``;
the router then decodes on the server, either plain autoregressive (an empty tree per
round: one target step, batched with everyone else's verifies) or server-side
speculative decoding (a drafter in the router builds the trees). Pure module.

Follows the OpenAI API reference (completions, chat completions, models): what the
server implements is parsed and type-checked here (ranges are the verifier's own
check, :meth:`deploy.verifier.sampling.SamplingParams.validate`); what it does not
implement (logprobs, penalties, tools, ...) is refused with a 400 unless the request
asks for its no-op value, and unknown fields are refused, never silently ignored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from deploy.errors import InvalidRequest, ModelNotFound

MODES = ("ar", "sd")
MAX_STOP = 4  # OpenAI: "up to 4 sequences"
DEFAULT_MAX_TOKENS = 128

# this project's extras beyond OpenAI's fields (vLLM-style sampling, server decode mode)
EXTRAS = {"mode", "top_k", "stop_token_ids", "ignore_eos", "max_completion_tokens"}
# accepted and ignored: they change nothing about the generated text
IGNORED = {"user", "metadata", "parallel_tool_calls"}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_default(*values):
    """A check that a value is one of ``values``, type included (``0`` is not ``False``)."""
    return lambda v: any(v is d or (v == d and type(v) is type(d)) for d in values)


def _is_zero(v) -> bool:
    return v is None or (_is_number(v) and v == 0)


# not implemented: accepted only at their no-op value, a 400 otherwise
NOOP = {
    "logprobs": _is_default(None, False),
    "top_logprobs": _is_default(None),
    "presence_penalty": _is_zero,
    "frequency_penalty": _is_zero,
    "logit_bias": _is_default(None, {}),
    "tools": _is_default(None, []),
    "functions": _is_default(None, []),
    "tool_choice": _is_default(None, "none"),
    "function_call": _is_default(None, "none"),
    "response_format": _is_default(None, {"type": "text"}),
    "store": _is_default(None, False),
    "echo": _is_default(None, False),
    "suffix": _is_default(None, ""),
    "best_of": _is_default(None, 1),
}
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"} | EXTRAS | IGNORED
FIELDS = {False: COMMON | {"prompt", "echo", "suffix", "best_of"},
          True: COMMON | {"messages", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
                          "response_format", "store"}}

# chat roles -> the chat template's; 'developer' is OpenAI's newer name for system instructions
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MESSAGE_FIELDS = {"role", "content", "name"}


@dataclass(frozen=True)
class CompletionRequest:
    """A validated OpenAI (chat) completion request, as the server decode needs it."""

    prompt: list[int]
    sampling: dict  # input of SamplingParams.from_dict
    chat: bool = False
    stream: bool = False
    mode: str = "ar"
    stop: tuple[str, ...] = ()  # OpenAI ``stop``: the text ends before the first of these
    include_usage: bool = False  # ``stream_options.include_usage``: a last chunk with the usage
    model: str | None = None  # None: the served model


def parse_completion(body: dict, tokenizer, chat: bool) -> CompletionRequest:
    """A /v1/completions (``chat=False``) or /v1/chat/completions body -> the request, or InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    _check_fields(body, chat)
    if chat:
        ids = chat_prompt(body.get("messages"), tokenizer)
    else:
        ids = completion_prompt(body.get("prompt"), tokenizer)
    stream = _opt(body, "stream", bool, False)
    stop = _stop(body.get("stop"))
    if stop and tokenizer is None:
        raise InvalidRequest("'stop' strings need a tokenizer; this target has none: use 'stop_token_ids'")
    mode = body.get("mode") or "ar"
    if mode not in MODES:
        raise InvalidRequest(f"'mode' must be one of {MODES}")
    if _opt(body, "n", int, 1) != 1:
        raise InvalidRequest("only n=1 is supported")
    return CompletionRequest(list(ids), _sampling(body), chat, stream, mode, stop,
                             _include_usage(body.get("stream_options"), stream), _opt(body, "model", str, None))


def _check_fields(body: dict, chat: bool) -> None:
    unknown = sorted(set(body) - FIELDS[chat])
    if unknown:
        raise InvalidRequest(f"unsupported fields: {unknown}")
    for key, is_noop in NOOP.items():
        if key in body and not is_noop(body[key]):
            raise InvalidRequest(f"'{key}' is not supported by this server (only its default value is accepted)")


def _opt(body: dict, key: str, kind: type, default):
    """``body[key]`` of type ``kind`` (bool is not an int), ``default`` when absent or null."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise InvalidRequest(f"'{key}' must be {'an' if kind is int else 'a'} {kind.__name__}, got {v!r}")
    return v


def _finite(body: dict, key: str, default: float) -> float:
    """``body[key]`` as a finite float (JSON numbers only; no NaN, no infinity)."""
    v = body.get(key)
    if v is None:
        return default
    try:
        if _is_number(v) and math.isfinite(float(v)):
            return float(v)
    except OverflowError:
        pass
    raise InvalidRequest(f"'{key}' must be a finite number, got {v!r}")


def _token_ids(v, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise InvalidRequest(f"'{what}' must be a list of token ids")
    return v


def _sampling(body: dict) -> dict:
    """The sampling dict (SamplingParams fields); ranges are checked by ``check_sampling``."""
    max_tokens = _opt(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = _opt(body, "max_completion_tokens", int, DEFAULT_MAX_TOKENS)
    return {
        "temperature": _finite(body, "temperature", 1.0),  # OpenAI's default
        "top_p": _finite(body, "top_p", 1.0),
        "top_k": _opt(body, "top_k", int, 0),
        "max_tokens": max_tokens,
        "seed": _opt(body, "seed", int, None),
        "stop_token_ids": _token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        "ignore_eos": _opt(body, "ignore_eos", bool, False),
    }


def check_sampling(sampling: dict, vocab_size: int) -> None:
    """The verifier's own range check (InvalidSamplingParams, a 400), run before a response starts."""
    from deploy.verifier.sampling import SamplingParams  # imports torch: only when a request needs it

    SamplingParams.from_dict(sampling).validate(vocab_size)


def _stop(v) -> tuple[str, ...]:
    """OpenAI ``stop``: a string or a list of up to 4 (non-empty) strings."""
    stops = [v] if isinstance(v, str) else [] if v is None else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("'stop' must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP} strings")
    return tuple(stops)


def _include_usage(options, stream: bool) -> bool:
    """OpenAI ``stream_options``: only with ``stream``; ``include_usage`` is its one option here."""
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidRequest("'stream_options' must be {\"include_usage\": true|false}")
    return _opt(options, "include_usage", bool, False)


def completion_prompt(prompt, tokenizer) -> list[int]:
    """/v1/completions ``prompt``: a non-empty string (needs a tokenizer) or list of token ids."""
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise InvalidRequest("this deployment's target has no tokenizer: send 'prompt' as token ids")
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, list) and prompt:
        return _token_ids(prompt, "prompt")
    raise InvalidRequest("'prompt' must be a non-empty string or a list of token ids")


def chat_prompt(messages, tokenizer) -> list[int]:
    """/v1/chat/completions ``messages`` -> prompt ids through the tokenizer's chat template."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of {role, content}")
    msgs = [chat_message(i, m) for i, m in enumerate(messages)]
    if tokenizer is None:
        raise InvalidRequest("this deployment's target has no tokenizer; use /v1/sessions with token ids")
    from jinja2 import TemplateError  # chat templates are jinja; a template may raise on a conversation

    try:
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    except (TemplateError, ValueError) as e:
        raise InvalidRequest(f"the chat template refused these messages: {e}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def chat_message(i: int, m) -> dict:
    """One OpenAI chat message -> ``{role, content: str}``; content may be a string or a list of
    text parts (joined with newlines, as vLLM does), null only for the assistant."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object with 'role' and 'content'")
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}")
    extra = sorted(k for k, v in m.items() if k not in MESSAGE_FIELDS and v is not None)
    if extra:
        raise InvalidRequest(f"{where}: unsupported fields {extra} (no tools, audio or refusals)")
    content = m.get("content")
    if content is None and role == "assistant":  # OpenAI: optional for the assistant only
        content = ""
    elif isinstance(content, list) and content:
        content = "\n".join(_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequest(f"{where}.content must be a string or a non-empty list of text parts")
    return {"role": ROLES[role], "content": content}


def _text_part(where: str, part) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequest(f"{where}: only text content parts are supported, got {kind!r}")


def check_model(requested: str | None, served: tuple[str, ...], versions: tuple[str, ...] | list[str] = ()) -> None:
    """A request's ``model`` must name the served model (any of its names) or one of its target
    versions; absent is fine. The 404 names what is served."""
    if requested is not None and requested not in served and requested not in versions:
        also = f" and its versions {', '.join(map(repr, versions))}" if versions else ""
        raise ModelNotFound(f"model {requested!r} does not exist; this server serves {served[0]!r}{also}")


def model_list(model: str, created: int, versions: tuple[str, ...] | list[str] = ()) -> dict:
    """OpenAI's ``GET /v1/models`` answer: the served model, then its target versions (LoRA fine-tunes)."""
    return {"object": "list", "data": [model_card(model, created)] + [model_card(v, created) for v in versions]}


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "specedge"}


# -- stop strings --------------------------------------------------------------------------
def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index of the earliest occurrence of any stop string in ``text``, or None."""
    return min((i for s in stops if (i := text.find(s)) >= 0), default=None)


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that begins a stop string (it may still become
    one, so it must not be sent yet)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class TextStream:
    """Decoded text released to a client as it grows, with OpenAI ``stop`` strings applied:
    the text ends before the first stop string, and no part of a stop string is ever sent
    (a tail that could begin one is held back, as is an incomplete UTF-8 sequence)."""

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = stops
        self.sent = ""

    def push(self, text: str, final: bool) -> tuple[str, bool]:
        """All text decoded so far -> (the new part safe to send, whether a stop string ended it)."""
        cut = find_stop(text, self.stops)
        if cut is not None:
            return self._release(text[:cut]), True
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for more tokens
            text = text[:len(text) - stop_prefix_len(text, self.stops)]
        return self._release(text), False

    def _release(self, text: str) -> str:
        delta = text[len(self.sent):]
        self.sent += delta
        return delta


# -- responses -----------------------------------------------------------------------------
def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _choice(chat: bool, finish: str | None, **content) -> dict:
    choice = {"index": 0, **content, "finish_reason": finish}
    if not chat:
        choice["logprobs"] = None
    return choice


def completion_response(model: str, text: str, ids: list[int], prompt_len: int, finish: str | None,
                        chat: bool, stats: dict, cached_tokens: int = 0) -> dict:
    """A non-streaming ``chat.completion`` / ``text_completion`` object (``specedge``: our stats)."""
    content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"id": completion_id(chat), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [_choice(chat, finish or "length", **content)],
            "usage": usage(prompt_len, len(ids), cached_tokens), "specedge": stats}


def _event(cid: str, model: str, chat: bool, choices: list, **extra) -> str:
    obj = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices, **extra}
    return f"data: {json.dumps(obj)}\n\n"


def stream_chunk(cid: str, model: str, delta: str, finish: str | None, chat: bool, *, role: bool = False,
                 with_usage: bool = False) -> str:
    """One SSE chunk; ``role``: the chat stream's first delta names the assistant; ``with_usage``:
    OpenAI's ``"usage": null`` on every chunk but the last when ``include_usage`` is set."""
    if chat:
        content = {"delta": {"role": "assistant", "content": delta} if role else {"content": delta} if delta else {}}
    else:
        content = {"text": delta}
    extra = {"usage": None} if with_usage else {}
    return _event(cid, model, chat, [_choice(chat, finish, **content)], **extra)


def usage_chunk(cid: str, model: str, chat: bool, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> str:
    """The last chunk of a stream with ``include_usage``: no choices, the whole request's usage."""
    return _event(cid, model, chat, [], usage=usage(prompt_tokens, completion_tokens, cached_tokens))
