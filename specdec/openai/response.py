"""OpenAI responses: a generation's rounds -> ``chat.completion`` / ``text_completion`` objects or server-sent event
chunks, ``stop`` strings applied (no part of one is ever sent); the round generator is closed however it ends."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from specdec import clock
from specdec.errors import SpecError
from specdec.openai.request import CompletionRequest
from specdec.openai.tools import ToolCall, ToolRequest, ToolSplitter


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
    """Length of the longest tail of ``text`` that begins a stop string (not to be sent yet)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class TextStream:
    """Decoded text released to a client as it grows, cut before the first OpenAI ``stop`` string; a tail that
    could begin one is held back, as is an incomplete UTF-8 sequence."""

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
    """OpenAI's ``logprobs`` of a choice for these :class:`~specdec.protocol.TokenLogprob` (None: none). Chat:
    ``{"content": [{token, logprob, bytes, top_logprobs}]}``; completions: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token -> logprob) and ``text_offset`` from ``offset``."""
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
                        chat: bool, stats: dict, cached_tokens: int = 0, logprobs: dict | None = None,
                        tool_calls: list[ToolCall] = ()) -> dict:
    """A non-streaming ``chat.completion`` / ``text_completion`` object (``specedge``: our stats)."""
    message = {"role": "assistant", "content": text or None if tool_calls else text}
    if tool_calls:
        message["tool_calls"] = [c.to_dict() for c in tool_calls]
    content = {"message": message} if chat else {"text": text}
    return {"id": completion_id(chat), "object": "chat.completion" if chat else "text_completion",
            "created": int(clock.wall()), "model": model,
            "choices": [_choice(chat, finish or "length", logprobs, **content)],
            "usage": usage(prompt_len, len(ids), cached_tokens), "specedge": stats}


def _event(cid: str, model: str, chat: bool, choices: list, **extra) -> str:
    obj = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(clock.wall()),
           "model": model, "choices": choices, **extra}
    return f"data: {json.dumps(obj)}\n\n"


def stream_chunk(cid: str, model: str, delta: str, finish: str | None, chat: bool, *, role: bool = False,
                 with_usage: bool = False, logprobs: dict | None = None, tool_calls: list[dict] = ()) -> str:
    """One SSE chunk; ``role``: the chat stream's first delta names the assistant; ``with_usage``:
    OpenAI's ``"usage": null`` on every chunk but the last when ``include_usage`` is set; ``tool_calls``:
    their ``delta.tool_calls`` items."""
    if chat:
        d = {"role": "assistant", "content": delta or None if tool_calls else delta} if role else {}
        if delta and not role:
            d["content"] = delta
        content = {"delta": {**d, "tool_calls": list(tool_calls)} if tool_calls else d}
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
    tool_calls: tuple[ToolCall, ...] = ()  # calls completed in this round (their text is not in ``text``)


async def texts(rounds, tokenizer, stops: tuple[str, ...], tools: ToolRequest | None = None):
    """:class:`Round` s -> :class:`TextDelta` s cut at the first ``stop`` string, one per round with new tokens (the
    text may be empty), tool calls parsed out (``finish_reason`` "tool_calls" when a call ended the text); closes
    ``rounds`` once a stop string ends the text, or when this generator is closed."""
    text, ids = TextStream(stops), []
    calls = ToolSplitter(tools) if tools is not None and tools.parses else None
    try:
        async for r in rounds:
            ids.extend(r.tokens)
            delta, stopped = text.push(tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None
                                       else "", final=r.finish is not None)
            finish = "stop" if stopped else r.finish
            new = ()
            if calls is not None:
                delta, new = calls.push(text.sent, final=finish is not None)
                finish = "tool_calls" if finish == "stop" and calls.calls else finish
            if r.tokens or finish:
                yield TextDelta(delta, finish, list(ids), r.stats, r.logprobs, tuple(new))
            if finish:
                return
    finally:
        await rounds.aclose()


async def whole_response(deltas, req: CompletionRequest, model: str, tokenizer) -> dict:
    """A non-streaming response from the :func:`texts` of a generation."""
    text, d, lps, calls = "", None, [] if req.logprobs is not None else None, []
    async for d in deltas:
        text += d.text
        calls += d.tool_calls
        if lps is not None:
            lps += d.logprobs or []
    ids, stats = (d.ids, d.stats) if d is not None else ([], {})
    return completion_response(model, text, ids, len(req.prompt), d.finish if d else None, req.chat,
                               {**stats, "token_ids": ids}, stats.get("cached_tokens", 0),
                               logprobs_object(tokenizer, lps, req.chat), calls)


async def sse(deltas, req: CompletionRequest, model: str, tokenizer, on_error=None):
    """Server-sent events in OpenAI's chunk format, ``data: [DONE]`` last (with ``include_usage``, a usage chunk
    with ``choices: []`` before it). An error after the stream began is an ``{"error"}`` event (``on_error`` first)."""
    cid, ids, first, stats, offset, n_calls = completion_id(req.chat), [], True, {}, 0, 0
    try:
        async for d in deltas:
            lp = logprobs_object(tokenizer, d.logprobs, req.chat, offset) if req.logprobs is not None else None
            calls = [c.delta(n_calls + i) for i, c in enumerate(d.tool_calls)]
            yield stream_chunk(cid, model, d.text, d.finish, req.chat, role=first, with_usage=req.include_usage,
                               logprobs=lp, tool_calls=calls)
            offset, n_calls = offset + len(d.text), n_calls + len(calls)
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
