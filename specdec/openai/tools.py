"""OpenAI tool calls: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` parsed, the call syntax of the target's
model family (:data:`FORMATS`), the grammar that forces well-formed calls when ``tool_choice`` requires one, and
the calls parsed back out of the generated text, also while it streams (docs/specdec.md, "Tool calls")."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from specdec.errors import InvalidRequest
from specdec.grammar import GrammarSpec
from specdec.schema_support import exact_schema

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # a JSON schema of the arguments
    spec: dict  # the request's ``{"type": "function", "function": {...}}``, as chat templates take it


@dataclass(frozen=True)
class ToolFormat:
    """One model family's call syntax. Generated: each call is ``begin(name) arguments end``, calls joined by
    ``separator``, all inside ``open`` ... ``close``. Parsed: JSON calls (or lists of them), each block inside
    ``tag`` ... ``tag_close`` where the family has tags; ``args``: the key the arguments go under."""

    name: str
    call_begin: str  # up to the name: '{"name": "'
    args: str
    end: str
    separator: str
    open: str = ""
    close: str = ""
    tag: str = ""  # where calls begin in free text ("": only as the whole output)
    tag_close: str = ""
    in_template: bool = True  # the chat template renders ``tools``; else a system prompt of ours does

    def begin(self, name: str) -> str:
        return f'{self.call_begin}{name}", "{self.args}": '

    def grammar(self, tools: list[Tool], parallel: bool) -> GrammarSpec:
        """An XGrammar structural tag: one or more calls of ``tools`` (one only unless ``parallel``), nothing else."""
        tags = [{"type": "tag", "begin": self.begin(t.name),
                 "content": {"type": "json_schema", "json_schema": exact_schema(t.parameters, f"tools: {t.name}"),
                             "max_whitespace_cnt": 1},
                 "end": self.end} for t in tools]  # whitespace: at most one character where JSON allows it
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator, "at_least_one": True,
                 "stop_after_first": not parallel}
        parts = [{"type": "const_string", "value": self.open}, calls, {"type": "const_string", "value": self.close}]
        fmt = {"type": "sequence", "elements": parts} if self.open else calls
        return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))

    def section_start(self, text: str) -> int | None:
        """Where the calls begin in ``text``, or None."""
        if self.tag:
            i = text.find(self.tag)
            return i if i >= 0 else None
        body = text.lstrip()
        return len(text) - len(body) if body.startswith("{") else None

    def holdback(self, text: str) -> int:
        """How many characters at the end of ``text`` (no calls in it yet) could still begin calls."""
        if not self.tag:
            return len(text) if not text.strip() else 0
        return max((k for k in range(1, len(self.tag)) if text.endswith(self.tag[:k])), default=0)

    def parse(self, section: str) -> tuple[list[dict], int]:
        """The complete calls at the start of ``section`` (each ``{"name", "arguments"}``) and where they end."""
        calls, pos, dec = [], 0, json.JSONDecoder()
        while True:
            i = re.compile(r"\s*[;,]?\s*" if calls else r"\s*").match(section, pos).end()
            if self.tag:
                if not section.startswith(self.tag, i):
                    break
                i = re.compile(r"\s*").match(section, i + len(self.tag)).end()
            try:
                obj, j = dec.raw_decode(section, i)
            except ValueError:
                break
            found = _calls_in(obj, self.args)
            m = re.compile(r"\s*" + re.escape(self.tag_close)).match(section, j)
            if found is None or m is None:
                break
            calls, pos = calls + found, m.end()
        return calls, pos


def _calls_in(obj, args: str) -> list[dict] | None:
    """``{"name", args}`` (or a list of them) -> calls; None if it is not that."""
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for o in items:
        a = o.get(args, o.get("arguments")) if isinstance(o, dict) else None
        if not isinstance(o, dict) or not isinstance(o.get("name"), str) or not isinstance(a, dict):
            return None
        out.append({"name": o["name"], "arguments": a})
    return out or None


FORMATS = {
    # Hermes / Qwen2.5 / Qwen3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one block per call
    "hermes": ToolFormat("hermes", '<tool_call>\n{"name": "', "arguments", "}\n</tool_call>", "\n",
                         tag="<tool_call>", tag_close="</tool_call>"),
    # Llama 3.1-3.3 JSON tool calling: {"name": ..., "parameters": {...}}, calls joined by "; "
    "llama3_json": ToolFormat("llama3_json", '{"name": "', "parameters", "}", "; "),
    # SmolLM2-Instruct: <tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>; its template ignores tools
    "smollm2": ToolFormat("smollm2", '{"name": "', "arguments", "}", ", ", open="<tool_call>[",
                          close="]</tool_call>", tag="<tool_call>", tag_close="</tool_call>", in_template=False),
}


def format_for(tokenizer) -> ToolFormat:
    """The call syntax the tokenizer's chat template renders tools in: Hermes/Qwen when it speaks ``<tool_call>``,
    Llama 3 JSON when it has the ``ipython`` role; else SmolLM2's (whose template has no tools)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if "tools" in template and "<tool_call>" in template:
        return FORMATS["hermes"]
    if "tools" in template and ("ipython" in template or "<|python_tag|>" in template):
        return FORMATS["llama3_json"]
    return FORMATS["smollm2"]


SMOLLM2_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. Based on "
    "the question, make one or more function/tool calls to achieve the purpose. If none of the functions can be "
    "used, say so and answer without a call.\n\nYou have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, answer only in this format:\n<tool_call>[\n{{\"name\": \"func_name1\", \"arguments\": "
    "{{\"argument1\": \"value1\"}}}},\n... (more tool calls as required)\n]</tool_call>")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, its ``tool_choice`` (``auto`` | ``required`` | ``none`` | ``named``) and format."""

    tools: tuple[Tool, ...]
    choice: str
    named: str | None
    parallel: bool
    format: ToolFormat = field(default_factory=lambda: FORMATS["smollm2"])

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> GrammarSpec | None:
        """The grammar that forces the calls when ``tool_choice`` requires one (``required`` or a named function)."""
        if self.choice == "required":
            return self.format.grammar(list(self.tools), self.parallel)
        if self.choice == "named":
            return self.format.grammar([t for t in self.tools if t.name == self.named], False)
        return None

    def template_tools(self) -> list[dict] | None:
        return [t.spec for t in self.tools] if self.format.in_template else None

    def system_prompt(self) -> str | None:
        """The tool instructions for a template that has none (SmolLM2's)."""
        if self.format.in_template:
            return None
        return SMOLLM2_PROMPT.format(tools=json.dumps([t.spec["function"] for t in self.tools]))


def tools_of(body: dict, tokenizer) -> ToolRequest | None:
    """A chat body's ``tools``, ``tool_choice``, ``parallel_tool_calls`` (None: no tools); 400 naming the field."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise InvalidRequest("'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > 128:
        raise InvalidRequest("'tools' must be a list of at most 128 function tools", param="tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw))
    if len({t.name for t in tools}) != len(tools):
        raise InvalidRequest("'tools': function names must be unique", param="tools")
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if named not in {t.name for t in tools}:
            raise InvalidRequest("'tool_choice': {\"type\": \"function\", \"function\": {\"name\": <one of tools>}}",
                                 param="tool_choice")
        choice = "named"
    elif choice is None:
        choice = "auto"
    elif choice not in ("auto", "required", "none"):
        raise InvalidRequest("'tool_choice' must be 'none', 'auto', 'required' or a named function", param="tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    return ToolRequest(tools, choice, named, parallel, format_for(tokenizer))


def _tool(i: int, t) -> Tool:
    where = f"tools[{i}]"
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
        raise InvalidRequest(f"{where}: {{\"type\": \"function\", \"function\": {{\"name\": [A-Za-z0-9_.-]{{1,64}}, "
                             "...}}", param="tools")
    params = fn.get("parameters")
    if params is None:
        params = NO_PARAMETERS
    if not isinstance(params, dict):
        raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object", param="tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise InvalidRequest(f"{where}.function.description must be a string", param="tools")
    return Tool(fn["name"], params, {"type": "function", "function": {**fn, "parameters": params}})


# -- tool calls in the conversation ---------------------------------------------------------------------
def assistant_calls(where: str, calls) -> list[dict]:
    """An assistant message's ``tool_calls`` -> the chat template's ``{"type", "function": {name, arguments: dict}}``."""
    if not isinstance(calls, list) or not calls:
        raise InvalidRequest(f"{where}.tool_calls must be a non-empty list", param=where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise InvalidRequest(f"{where}.tool_calls[{j}]: {{id, type: 'function', function: {{name, arguments}}}}",
                                 param=where)
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise InvalidRequest(f"{where}.tool_calls[{j}].function.arguments is not JSON", param=where) from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def render_calls(fmt: ToolFormat, calls: list[dict]) -> str:
    """Calls (as :func:`assistant_calls` gives them) in the model's own syntax, for a template that has none."""
    text = fmt.separator.join(fmt.begin(c["function"]["name"]) + json.dumps(c["function"]["arguments"])
                              + fmt.end for c in calls)
    return fmt.open + text + fmt.close


# -- tool calls out of the generated text ----------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict:
        """The streamed form: OpenAI's ``delta.tool_calls`` item."""
        return {"index": index, **self.to_dict()}


class ToolSplitter:
    """Released text -> (content to send, completed calls): text from where calls begin is held until each call
    completes; at the end what never became a call is content again (nothing generated is lost)."""

    def __init__(self, request: ToolRequest):
        self.fmt = request.format
        self.sent, self.calls = "", []

    def push(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """All text released so far -> (new content, calls completed since the last push)."""
        start = self.fmt.section_start(text)
        if start is None:
            return self._content(text if final else text[:len(text) - self.fmt.holdback(text)]), []
        calls, end = self.fmt.parse(text[start:])
        new = [ToolCall(c["name"], json.dumps(c["arguments"])) for c in calls[len(self.calls):]]
        self.calls += new
        if final and not self.calls:  # no call after all: all of it is text
            return self._content(text), []
        content = self._content(text[:start])
        rest = text[start + end:].strip() if final else ""
        return content + rest, new

    def _content(self, text: str) -> str:
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta
