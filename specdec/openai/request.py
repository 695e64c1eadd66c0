"""OpenAI (chat) completion requests: parsed and type-checked, as vLLM serves the API: a :class:`CompletionRequest` or
:class:`~specdec.errors.InvalidRequest` (400, naming its ``param``). What is accepted: docs/protocol.md."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from specdec.errors import InvalidRequest, InvalidSamplingParams, ModelNotFound
from specdec.grammar import GrammarSpec
from specdec.openai.tools import ToolRequest, assistant_calls, format_for, render_calls, tools_of

MODES = ("ar", "sd")
MAX_STOP = 4  # OpenAI: "up to 4 sequences"
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"  # the response names the request's unknown fields, ignored

# this project's extras beyond OpenAI's fields (vLLM-style sampling, server decode mode)
EXTRAS = {"mode", "top_k", "stop_token_ids", "ignore_eos", "max_completion_tokens", "repetition_penalty",
          "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}
# vLLM's structured-output fields (and structured_outputs' keys) -> the grammar kind they ask for
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# accepted and ignored: they change nothing about the generated text
IGNORED = {"user", "metadata"}
# chat_template_kwargs the server sets itself (the rest go to the template, e.g. Qwen3's enable_thinking)
TEMPLATE_OWN = {"conversation", "tokenize", "return_dict", "return_tensors", "tools", "documents", "chat_template",
                "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_default(*values):
    """A check that a value is one of ``values``, type included (``0`` is not ``False``)."""
    return lambda v: any(v is d or (v == d and type(v) is type(d)) for d in values)


# not implemented: accepted only at their no-op value, a 400 otherwise
NOOP = {
    "logit_bias": _is_default(None, {}),
    "functions": _is_default(None, []),
    "function_call": _is_default(None, "none"),
    "store": _is_default(None, False),
    "echo": _is_default(None, False),
    "suffix": _is_default(None, ""),
    "best_of": _is_default(None, 1),
}
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"} | EXTRAS | IGNORED
FIELDS = {False: COMMON | {"prompt", "echo", "suffix", "best_of"},
          True: COMMON | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "functions",
                          "function_call", "store", "chat_template_kwargs"}}

# chat roles -> the chat template's; 'developer' is OpenAI's newer name for system instructions
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}


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
    grammar: GrammarSpec | None = None  # structured output: response_format, guided_*, structured_outputs, tools
    tools: ToolRequest | None = None  # chat ``tools``: calls are parsed out of the text

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
    tools, grammar = tools_of(body, tokenizer) if chat else None, grammar_of(body)
    if chat:
        ids = chat_prompt(body.get("messages"), tokenizer, chat_template_kwargs(body.get("chat_template_kwargs")),
                          tools)
        forced = tools.grammar() if tools is not None else None
        if forced is not None and grammar is not None:
            raise InvalidRequest("a 'tool_choice' that requires a call takes no other output constraint",
                                 param="tool_choice")
        grammar = forced or grammar
    else:
        ids = completion_prompt(body.get("prompt"), tokenizer)
    stream = optional(body, "stream", bool, False)
    stop = _stop(body.get("stop"))
    if stop and tokenizer is None:
        raise InvalidRequest("'stop' strings need a tokenizer; this target has none: use 'stop_token_ids'",
                             param="stop")
    mode = body.get("mode") or "ar"
    if mode not in MODES:
        raise InvalidRequest(f"'mode' must be one of {MODES}", param="mode")
    if optional(body, "n", int, 1) != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    return CompletionRequest(list(ids), _sampling(body, chat), chat, stream, mode, stop,
                             _include_usage(body.get("stream_options"), stream), optional(body, "model", str, None),
                             ignored, grammar, tools)


def grammar_of(body: dict) -> GrammarSpec | None:
    """The one output constraint a body asks for: OpenAI's ``response_format`` (``json_object``,
    ``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
    or ``structured_outputs`` ({json, regex, choice, grammar, json_object}); None; 400 for two or a bad one."""
    asks = {}
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            asks["response_format"] = ("json_object", None)
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise InvalidRequest("response_format.json_schema: an object with a 'schema' object",
                                     param="response_format")
            asks["response_format"] = ("json", js.get("schema", {}))
        elif kind != "text":
            raise InvalidRequest("response_format.type: 'text', 'json_object' or 'json_schema'", param="response_format")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict) or len(set(so) & {"json", "regex", "choice", "grammar", "json_object"}) != 1:
            raise InvalidRequest("structured_outputs: one of json, regex, choice, grammar, json_object",
                                 param="structured_outputs")
        key = next(k for k in so if k in ("json", "regex", "choice", "grammar", "json_object"))
        asks["structured_outputs"] = ("json_object", None) if key == "json_object" else (key, so[key])
    asks.update({field: (kind, body[field]) for field, kind in GUIDED.items() if body.get(field) is not None})
    if len(asks) > 1:
        raise InvalidRequest(f"one output constraint a request, got {', '.join(sorted(asks))}", param=sorted(asks)[1])
    if not asks:
        return None
    (field, (kind, value)), = asks.items()
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequest(f"{field}: not a JSON schema (not JSON)", param=field) from None
        return GrammarSpec("json_schema", json.dumps(value))
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{field}: a non-empty list of strings", param=field)
        return GrammarSpec("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field}: a non-empty string", param=field)
    return GrammarSpec("regex" if kind == "regex" else "ebnf", value)


def _check_fields(body: dict, chat: bool) -> tuple[str, ...]:
    """The unknown fields (ignored); a 400 for an unimplemented field at other than its no-op value."""
    for key, is_noop in NOOP.items():
        if key in body and key in FIELDS[chat] and not is_noop(body[key]):
            raise InvalidRequest(f"'{key}' is not supported by this server (only its default value is accepted)",
                                 param=key)
    return tuple(sorted(set(body) - FIELDS[chat]))


def chat_template_kwargs(v) -> dict:
    """vLLM's ``chat_template_kwargs``: extra variables for the chat template (e.g. ``enable_thinking``)."""
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise InvalidRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    own = sorted(set(v) & TEMPLATE_OWN)
    if own:
        raise InvalidRequest(f"'chat_template_kwargs' may not set {own}", param="chat_template_kwargs")
    return v


def optional(body: dict, key: str, kind: type, default):
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


def token_ids(v, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise InvalidRequest(f"'{what}' must be a list of token ids", param=what)
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token, or None. Chat: ``logprobs`` true and ``top_logprobs``; completions:
    ``logprobs`` is the number of alternatives."""
    if not chat:
        return optional(body, "logprobs", int, None)
    top = optional(body, "top_logprobs", int, None)
    if not optional(body, "logprobs", bool, False):
        if top is not None:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top or 0


def _sampling(body: dict, chat: bool) -> dict:
    """The sampling dict (SamplingParams fields; ranges: ``check_sampling``); ``max_tokens`` None: unset."""
    max_tokens = optional(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = optional(body, "max_completion_tokens", int, None)
    return {
        "temperature": _finite(body, "temperature", 1.0),  # OpenAI's default
        "top_p": _finite(body, "top_p", 1.0),
        "top_k": optional(body, "top_k", int, 0),
        "max_tokens": max_tokens,
        "seed": optional(body, "seed", int, None),
        "stop_token_ids": token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        "ignore_eos": optional(body, "ignore_eos", bool, False),
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
    return optional(options, "include_usage", bool, False)


def completion_prompt(prompt, tokenizer) -> list[int]:
    """/v1/completions ``prompt``: a non-empty string (needs a tokenizer) or list of token ids."""
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise InvalidRequest("this deployment's target has no tokenizer: send 'prompt' as token ids",
                                 param="prompt")
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, list) and prompt:
        return token_ids(prompt, "prompt")
    raise InvalidRequest("'prompt' must be a non-empty string or a list of token ids", param="prompt")


def chat_prompt(messages, tokenizer, template_kwargs: dict | None = None, tools: ToolRequest | None = None
                ) -> list[int]:
    """/v1/chat/completions ``messages`` -> prompt ids via the chat template (``template_kwargs``: extra variables;
    ``tools``: rendered by the template, or as a system prompt where the template has none)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of {role, content}", param="messages")
    msgs = [chat_message(i, m) for i, m in enumerate(messages)]
    if tokenizer is None:
        raise InvalidRequest("this deployment's target has no tokenizer; use /v1/sessions with token ids")
    msgs = _with_tools(msgs, tools.format if tools is not None else format_for(tokenizer), tools)
    from jinja2 import TemplateError  # chat templates are jinja; a template may raise on a conversation

    listed = tools.template_tools() if tools is not None else None
    extra = {"tools": listed} if listed else {}
    try:
        ids = tokenizer.apply_chat_template(msgs, **{"add_generation_prompt": True, **(template_kwargs or {}),
                                                     **extra, "tokenize": True})
    except (TemplateError, ValueError, TypeError) as e:
        raise InvalidRequest(f"the chat template refused these messages: {e}", param="messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def _with_tools(msgs: list[dict], fmt, tools: ToolRequest | None) -> list[dict]:
    """For a template without tools: the tool instructions as (or before) the system message and assistant calls
    written out in the model's syntax."""
    if fmt.in_template:
        return msgs
    out = [_calls_as_text(m, fmt) if "tool_calls" in m else m for m in msgs]
    prompt = tools.system_prompt() if tools is not None and tools.parses else None
    if prompt is None:
        return out
    if out[0]["role"] == "system":
        return [{"role": "system", "content": prompt + "\n\n" + out[0]["content"]}] + out[1:]
    return [{"role": "system", "content": prompt}] + out


def _calls_as_text(m: dict, fmt) -> dict:
    calls = render_calls(fmt, m["tool_calls"])
    return {"role": m["role"], "content": (m["content"] + "\n" if m["content"] else "") + calls}


def chat_message(i: int, m) -> dict:
    """One OpenAI chat message -> ``{role, content: str}`` (with ``tool_calls`` / ``tool_call_id`` where given);
    content may be a string or a list of text parts (joined with newlines, as vLLM does), null only for the
    assistant."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object with 'role' and 'content'", param=where)
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", param=where)
    extra = sorted(k for k, v in m.items() if k not in MESSAGE_FIELDS and v is not None)
    if extra:
        raise InvalidRequest(f"{where}: unsupported fields {extra} (no audio or refusals)", param=where)
    content = m.get("content")
    if content is None and role == "assistant":  # OpenAI: optional for the assistant only
        content = ""
    elif isinstance(content, list) and content:
        content = "\n".join(_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequest(f"{where}.content must be a string or a non-empty list of text parts", param=where)
    out = {"role": ROLES[role], "content": content}
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise InvalidRequest(f"{where}: only assistant messages carry 'tool_calls'", param=where)
        out["tool_calls"] = assistant_calls(where, m["tool_calls"])
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise InvalidRequest(f"{where}: a tool message needs its 'tool_call_id'", param=where)
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _text_part(where: str, part) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequest(f"{where}: only text content parts are supported, got {kind!r}", param=where)


def check_model(requested: str | None, served: tuple[str, ...], versions: tuple[str, ...] | list[str] = ()) -> None:
    """A request's ``model`` must name the served model or one of its versions (absent is fine), else a 404."""
    if requested is not None and requested not in served and requested not in versions:
        also = f" and its versions {', '.join(map(repr, versions))}" if versions else ""
        raise ModelNotFound(f"model {requested!r} does not exist; this server serves {served[0]!r}{also}")


def ignored_warning(fields: tuple[str, ...]) -> str:
    """vLLM's log line for a request's ignored fields."""
    return f"The following fields were present in the request but ignored: {set(fields)}"
