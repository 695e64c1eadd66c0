"""OpenAI-compatible request parsing and response shaping (server-only modes).

Clients without a draft model use ``/v1/completions`` and ``/v1/chat/completions``;
the router then decodes on the server, either plain autoregressive (an empty tree per
round: one target step, batched with everyone else's verifies) or server-side
speculative decoding (a drafter in the router builds the trees). Pure module.

Follows the OpenAI API reference (completions, chat completions, models) as vLLM serves
it: what the server implements is parsed and type-checked here (ranges are the verifier's
own check, :meth:`specdec.sampling.SamplingParams.validate`), with vLLM's extras
(``top_k``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``chat_template_kwargs``);
what changes the output but is not implemented (tools, ``response_format``, ``logit_bias``,
...) is refused with a 400 unless the request asks for its no-op value; unknown fields are
accepted and ignored, as vLLM does, and named back (:attr:`CompletionRequest.ignored`) for
the caller's warning and response header. ``max_tokens`` defaults to the rest of the context.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, replace

from specdec.errors import InvalidRequest, InvalidSamplingParams, ModelNotFound, SpecError

MODES = ("ar", "sd")
MAX_STOP = 4  # OpenAI: "up to 4 sequences"
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"  # the response names the request's unknown fields, ignored

# this project's extras beyond OpenAI's fields (vLLM-style sampling, server decode mode)
EXTRAS = {"mode", "top_k", "stop_token_ids", "ignore_eos", "max_completion_tokens", "repetition_penalty"}
# accepted and ignored: they change nothing about the generated text
IGNORED = {"user", "metadata", "parallel_tool_calls"}
# chat_template_kwargs the server sets itself (the rest go to the template, e.g. Qwen3's enable_thinking)
TEMPLATE_OWN = {"conversation", "tokenize", "return_dict", "return_tensors", "tools", "documents", "chat_template",
                "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_default(*values):
    """A check that a value is one of ``values``, type included (``0`` is not ``False``)."""
    return lambda v: any(v is d or (v == d and type(v) is type(d)) for d in values)


def _is_zero(v) -> bool:
    return v is None or (_is_number(v) and v == 0)


# not implemented: accepted only at their no-op value, a 400 otherwise
NOOP = {
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
                          "response_format", "store", "chat_template_kwargs"}}

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
    ignored: tuple[str, ...] = ()  # unknown fields, accepted and ignored (vLLM's behaviour)

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token when the request wants log-probs, else None."""
        return self.sampling.get("logprobs")

    def with_max_tokens(self, max_model_len: int) -> "CompletionRequest":
        """``max_tokens`` unset: the rest of the context (vLLM's default)."""
        if self.sampling.get("max_tokens") is not None:
            return self
        return replace(self, sampling={**self.sampling, "max_tokens": max(1, max_model_len - len(self.prompt) - 1)})


def parse_completion(body: dict, tokenizer, chat: bool) -> CompletionRequest:
    """A /v1/completions (``chat=False``) or /v1/chat/completions body -> the request, or InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    ignored = _check_fields(body, chat)
    if chat:
        ids = chat_prompt(body.get("messages"), tokenizer, _template_kwargs(body.get("chat_template_kwargs")))
    else:
        ids = completion_prompt(body.get("prompt"), tokenizer)
    stream = _opt(body, "stream", bool, False)
    stop = _stop(body.get("stop"))
    if stop and tokenizer is None:
        raise InvalidRequest("'stop' strings need a tokenizer; this target has none: use 'stop_token_ids'",
                             param="stop")
    mode = body.get("mode") or "ar"
    if mode not in MODES:
        raise InvalidRequest(f"'mode' must be one of {MODES}", param="mode")
    if _opt(body, "n", int, 1) != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    return CompletionRequest(list(ids), _sampling(body, chat), chat, stream, mode, stop,
                             _include_usage(body.get("stream_options"), stream), _opt(body, "model", str, None),
                             ignored)


def _check_fields(body: dict, chat: bool) -> tuple[str, ...]:
    """The unknown fields (ignored); a 400 for an unimplemented field at other than its no-op value."""
    for key, is_noop in NOOP.items():
        if key in body and key in FIELDS[chat] and not is_noop(body[key]):
            raise InvalidRequest(f"'{key}' is not supported by this server (only its default value is accepted)",
                                 param=key)
    return tuple(sorted(set(body) - FIELDS[chat]))


def _template_kwargs(v) -> dict:
    """vLLM's ``chat_template_kwargs``: extra variables for the chat template (e.g. ``enable_thinking``)."""
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise InvalidRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    own = sorted(set(v) & TEMPLATE_OWN)
    if own:
        raise InvalidRequest(f"'chat_template_kwargs' may not set {own}", param="chat_template_kwargs")
    return v


def _opt(body: dict, key: str, kind: type, default):
    """``body[key]`` of type ``kind`` (bool is not an int), ``default`` when absent or null."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise InvalidRequest(f"'{key}' must be {'an' if kind is int else 'a'} {kind.__name__}, got {v!r}", param=key)
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
    raise InvalidRequest(f"'{key}' must be a finite number, got {v!r}", param=key)


def _token_ids(v, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise InvalidRequest(f"'{what}' must be a list of token ids", param=what)
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token, or None. Chat: ``logprobs`` true and ``top_logprobs``; completions:
    ``logprobs`` is the number of alternatives."""
    if not chat:
        return _opt(body, "logprobs", int, None)
    top = _opt(body, "top_logprobs", int, None)
    if not _opt(body, "logprobs", bool, False):
        if top is not None:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top or 0


def _sampling(body: dict, chat: bool) -> dict:
    """The sampling dict (SamplingParams fields); ranges are checked by ``check_sampling``.
    ``max_tokens`` None: unset (:meth:`CompletionRequest.with_max_tokens`)."""
    max_tokens = _opt(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = _opt(body, "max_completion_tokens", int, None)
    return {
        "temperature": _finite(body, "temperature", 1.0),  # OpenAI's default
        "top_p": _finite(body, "top_p", 1.0),
        "top_k": _opt(body, "top_k", int, 0),
        "max_tokens": max_tokens,
        "seed": _opt(body, "seed", int, None),
        "stop_token_ids": _token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        "ignore_eos": _opt(body, "ignore_eos", bool, False),
        "presence_penalty": _finite(body, "presence_penalty", 0.0),
        "frequency_penalty": _finite(body, "frequency_penalty", 0.0),
        "repetition_penalty": _finite(body, "repetition_penalty", 1.0),
        "logprobs": _logprobs(body, chat),
    }


def check_sampling(sampling: dict, vocab_size: int) -> None:
    """The verifier's own range check (InvalidSamplingParams, a 400), run before a response starts."""
    from specdec.sampling import SamplingParams  # imports torch: only when a request needs it

    try:
        SamplingParams.from_dict({k: v for k, v in sampling.items() if v is not None or k != "max_tokens"}
                                 ).validate(vocab_size)
    except InvalidSamplingParams as e:  # its message starts with the field's name
        name = e.message.split(" ", 1)[0]
        if name in SamplingParams.__dataclass_fields__:
            e.details.setdefault("param", name)
        raise


def _stop(v) -> tuple[str, ...]:
    """OpenAI ``stop``: a string or a list of up to 4 (non-empty) strings."""
    stops = [v] if isinstance(v, str) else [] if v is None else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stops) > MAX_STOP:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP} strings", param="stop")
    return tuple(stops)


def _include_usage(options, stream: bool) -> bool:
    """OpenAI ``stream_options``: only with ``stream``; ``include_usage`` is its one option here."""
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidRequest("'stream_options' must be {\"include_usage\": true|false}", param="stream_options")
    return _opt(options, "include_usage", bool, False)


def completion_prompt(prompt, tokenizer) -> list[int]:
    """/v1/completions ``prompt``: a non-empty string (needs a tokenizer) or list of token ids."""
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise InvalidRequest("this deployment's target has no tokenizer: send 'prompt' as token ids",
                                 param="prompt")
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, list) and prompt:
        return _token_ids(prompt, "prompt")
    raise InvalidRequest("'prompt' must be a non-empty string or a list of token ids", param="prompt")


def chat_prompt(messages, tokenizer, template_kwargs: dict | None = None) -> list[int]:
    """/v1/chat/completions ``messages`` -> prompt ids through the tokenizer's chat template
    (``template_kwargs``: extra template variables)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of {role, content}", param="messages")
    msgs = [chat_message(i, m) for i, m in enumerate(messages)]
    if tokenizer is None:
        raise InvalidRequest("this deployment's target has no tokenizer; use /v1/sessions with token ids")
    from jinja2 import TemplateError  # chat templates are jinja; a template may raise on a conversation

    try:
        ids = tokenizer.apply_chat_template(msgs, **{"add_generation_prompt": True, **(template_kwargs or {}),
                                                     "tokenize": True})
    except (TemplateError, ValueError, TypeError) as e:
        raise InvalidRequest(f"the chat template refused these messages: {e}", param="messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def chat_message(i: int, m) -> dict:
    """One OpenAI chat message -> ``{role, content: str}``; content may be a string or a list of
    text parts (joined with newlines, as vLLM does), null only for the assistant."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object with 'role' and 'content'", param=where)
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", param=where)
    extra = sorted(k for k, v in m.items() if k not in MESSAGE_FIELDS and v is not None)
    if extra:
        raise InvalidRequest(f"{where}: unsupported fields {extra} (no tools, audio or refusals)", param=where)
    content = m.get("content")
    if content is None and role == "assistant":  # OpenAI: optional for the assistant only
        content = ""
    elif isinstance(content, list) and content:
        content = "\n".join(_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequest(f"{where}.content must be a string or a non-empty list of text parts", param=where)
    return {"role": ROLES[role], "content": content}


def _text_part(where: str, part) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequest(f"{where}: only text content parts are supported, got {kind!r}", param=where)


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


def _choice(chat: bool, finish: str | None, logprobs: dict | None = None, **content) -> dict:
    return {"index": 0, **content, "logprobs": logprobs, "finish_reason": finish}


# -- logprobs ------------------------------------------------------------------------------
def token_text(tokenizer, token: int) -> str:
    """A token as the logprobs name it: its decoded text (``token_id:<id>`` without a tokenizer, as vLLM)."""
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def logprobs_object(tokenizer, lps, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's ``logprobs`` of a choice for these :class:`~specdec.protocol.TokenLogprob` (None: none).

    Chat: ``{"content": [{token, logprob, bytes, top_logprobs}]}``; completions: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (token -> logprob) and ``text_offset`` from ``offset``."""
    if lps is None:
        return None
    names = [token_text(tokenizer, lp.token) for lp in lps]
    tops = [[(token_text(tokenizer, i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)] for lp in lps]
    if chat:
        return {"content": [{"token": n, "logprob": lp.logprob, "bytes": list(n.encode()),
                             "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]}
                            for n, lp, top in zip(names, lps, tops)]}
    offsets = [offset + sum(len(n) for n in names[:j]) for j in range(len(names))]
    return {"tokens": names, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [dict(top) for top in tops], "text_offset": offsets}


def completion_response(model: str, text: str, ids: list[int], prompt_len: int, finish: str | None,
                        chat: bool, stats: dict, cached_tokens: int = 0, logprobs: dict | None = None) -> dict:
    """A non-streaming ``chat.completion`` / ``text_completion`` object (``specedge``: our stats)."""
    content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"id": completion_id(chat), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [_choice(chat, finish or "length", logprobs, **content)],
            "usage": usage(prompt_len, len(ids), cached_tokens), "specedge": stats}


def _event(cid: str, model: str, chat: bool, choices: list, **extra) -> str:
    obj = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices, **extra}
    return f"data: {json.dumps(obj)}\n\n"


def stream_chunk(cid: str, model: str, delta: str, finish: str | None, chat: bool, *, role: bool = False,
                 with_usage: bool = False, logprobs: dict | None = None) -> str:
    """One SSE chunk; ``role``: the chat stream's first delta names the assistant; ``with_usage``:
    OpenAI's ``"usage": null`` on every chunk but the last when ``include_usage`` is set."""
    if chat:
        content = {"delta": {"role": "assistant", "content": delta} if role else {"content": delta} if delta else {}}
    else:
        content = {"text": delta}
    extra = {"usage": None} if with_usage else {}
    return _event(cid, model, chat, [_choice(chat, finish, logprobs, **content)], **extra)


def usage_chunk(cid: str, model: str, chat: bool, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> str:
    """The last chunk of a stream with ``include_usage``: no choices, the whole request's usage."""
    return _event(cid, model, chat, [], usage=usage(prompt_tokens, completion_tokens, cached_tokens))


# -- a generation -> OpenAI responses ---------------------------------------------------------
@dataclass(frozen=True)
class Round:
    """New tokens of a generation (a server decode's round, an edge agent's step)."""

    tokens: list[int]
    finish: str | None  # "stop" | "length" | None: more to come
    stats: dict
    logprobs: list | None = None  # TokenLogprob per token, when the request wants them


@dataclass(frozen=True)
class TextDelta:
    """Text released to the client after a round (stop strings applied)."""

    text: str
    finish: str | None
    ids: list[int]  # all generated ids so far
    stats: dict
    logprobs: list | None  # this round's tokens'


async def texts(rounds, tokenizer, stops: tuple[str, ...]):
    """:class:`Round` s -> :class:`TextDelta` s, cut at the first ``stop`` string (OpenAI). Yields
    per round with new tokens (the text may be empty: held back, or no tokenizer); closes ``rounds``
    as soon as a stop string ends the text, and when this generator is closed or abandoned."""
    text, ids = TextStream(stops), []
    try:
        async for r in rounds:
            ids.extend(r.tokens)
            delta, stopped = text.push(tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None
                                       else "", final=r.finish is not None)
            finish = "stop" if stopped else r.finish
            if r.tokens or finish:
                yield TextDelta(delta, finish, list(ids), r.stats, r.logprobs)
            if finish:
                return
    finally:
        await rounds.aclose()


async def whole_response(deltas, req: CompletionRequest, model: str, tokenizer) -> dict:
    """A non-streaming response from the :func:`texts` of a generation."""
    text, d, lps = "", None, [] if req.logprobs is not None else None
    async for d in deltas:
        text += d.text
        if lps is not None:
            lps += d.logprobs or []
    ids, stats = (d.ids, d.stats) if d is not None else ([], {})
    return completion_response(model, text, ids, len(req.prompt), d.finish if d else None, req.chat,
                               {**stats, "token_ids": ids}, stats.get("cached_tokens", 0),
                               logprobs_object(tokenizer, lps, req.chat))


async def sse(deltas, req: CompletionRequest, model: str, tokenizer, on_error=None):
    """Server-sent events in OpenAI's chunk format, ``data: [DONE]`` last; with
    ``stream_options.include_usage`` a last chunk with ``choices: []`` and the usage. An error
    after the stream began is an ``{"error"}`` event (``on_error`` sees it first)."""
    cid, ids, first, stats, offset = completion_id(req.chat), [], True, {}, 0
    try:
        async for d in deltas:
            lp = logprobs_object(tokenizer, d.logprobs, req.chat, offset) if req.logprobs is not None else None
            yield stream_chunk(cid, model, d.text, d.finish, req.chat, role=first, with_usage=req.include_usage,
                               logprobs=lp)
            offset += len(d.text)
            first, ids, stats = False, d.ids, d.stats
        if req.include_usage:
            yield usage_chunk(cid, model, req.chat, len(req.prompt), len(ids), stats.get("cached_tokens", 0))
    except SpecError as e:
        if on_error is not None:
            on_error(e)
        yield f"data: {json.dumps(e.to_dict())}\n\n"
    finally:
        await deltas.aclose()
    yield "data: [DONE]\n\n"


def ignored_warning(fields: tuple[str, ...]) -> str:
    """vLLM's log line for a request's ignored fields."""
    return f"The following fields were present in the request but ignored: {set(fields)}"


# -- vLLM's /tokenize, /detokenize, /version ---------------------------------------------------
TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "messages", "add_generation_prompt",
                   "chat_template_kwargs", "return_token_strs"}


def tokenize(body: dict, tokenizer, max_model_len: int) -> dict:
    """vLLM's ``POST /tokenize``: a ``prompt`` (text) or chat ``messages`` -> ``count``, ``tokens``,
    ``max_model_len`` (and ``token_strs`` when asked)."""
    if tokenizer is None:
        raise InvalidRequest("this deployment's target has no tokenizer")
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("send a 'prompt' (text) or chat 'messages'")
    if "messages" in body:
        kwargs = {**_template_kwargs(body.get("chat_template_kwargs")),
                  "add_generation_prompt": _opt(body, "add_generation_prompt", bool, True)}
        ids = chat_prompt(body["messages"], tokenizer, kwargs)
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequest("'prompt' must be a string", param="prompt")
        ids = tokenizer(prompt, add_special_tokens=_opt(body, "add_special_tokens", bool, True))["input_ids"]
    out = {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids), "token_strs": None}
    if _opt(body, "return_token_strs", bool, False):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(list(ids))
    return out


def detokenize(body: dict, tokenizer, vocab_size: int) -> dict:
    """vLLM's ``POST /detokenize``: ``tokens`` -> ``prompt`` (the text)."""
    if tokenizer is None:
        raise InvalidRequest("this deployment's target has no tokenizer")
    ids = _token_ids(body.get("tokens") if isinstance(body, dict) else None, "tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token ids {bad[:4]} are outside the vocabulary [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(ids)}


def server_version() -> dict:
    """vLLM's ``GET /version``: this package's version."""
    from importlib.metadata import version

    return {"version": version("specedge-serve")}
