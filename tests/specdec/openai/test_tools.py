"""specdec/openai/tools.py: tools and tool_choice parsed, each family's call syntax written, forced by its grammar
and parsed back, also while the text streams; the calls in OpenAI's response and chunk shapes."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from specdec.errors import InvalidRequest
from specdec.grammar import GrammarCompiler
from specdec.model.loading import load_tokenizer
from specdec.openai import request as rq
from specdec.openai.response import Round, sse, texts, whole_response
from specdec.openai.tools import FORMATS, ToolRequest, ToolSplitter, format_for, tools_of
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                     "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLS = {  # two calls in each family's syntax, as the model writes them
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
                   '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "smollm2": '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
               '{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>',
}
# the shape of each family's chat template where it renders tools (Qwen2.5's <tools> block, Llama 3.1's ipython)
HERMES_TEMPLATE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
                   " Call a tool inside <tool_call></tool_call>.<|im_end|>\n{% endif %}{% for m in messages %}"
                   "<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>\n"
                   "{{ c.function | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
LLAMA3_TEMPLATE = ("{% if tools %}Environment: ipython\n{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
                   "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded")


def with_template(tok, template: str):
    t = load_tokenizer("embedded")
    t.chat_template = template
    return t


def test_tools_and_tool_choice_parse(tok):
    req = tools_of({"tools": [WEATHER, ADD]}, tok)
    assert req.choice == "auto" and not req.grammar() and req.parallel and req.format.name == "smollm2"
    req = tools_of({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}},
                    "parallel_tool_calls": False}, tok)
    assert (req.choice, req.named, req.parallel) == ("named", "add", False)
    assert json.loads(req.grammar().value)["format"]["elements"][1]["tags"][0]["begin"].endswith('"add", "arguments": ')
    assert tools_of({"tools": [], "tool_choice": "none"}, tok) is None
    assert tools_of({"tools": [{"type": "function", "function": {"name": "noargs"}}]}, tok).tools[0].parameters


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "auto"}, "tool_choice"),  # no tools
    ({"tools": {"f": 1}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(tok, body, param):
    with pytest.raises(InvalidRequest) as e:
        rq.parse_completion({"messages": ASK, **body}, tok, True)
    assert e.value.details["param"] == param


def test_the_format_follows_the_chat_template(tok):
    assert format_for(tok).name == "smollm2"  # SmolLM2's template ignores tools
    assert format_for(with_template(tok, HERMES_TEMPLATE)).name == "hermes"
    assert format_for(with_template(tok, LLAMA3_TEMPLATE)).name == "llama3_json"


def test_prompts_carry_the_tools_and_the_conversation_its_calls_and_results(tok):
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    text = tok.decode(rq.parse_completion({"messages": turn, "tools": [WEATHER]}, tok, True).prompt)
    assert "<tools>" in text and '"get_weather"' in text and "You are a helpful" not in text  # ours replaces it
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]</tool_call>' in text
    assert "<|im_start|>tool\n18 C, sunny" in text
    hermes = with_template(tok, HERMES_TEMPLATE)
    text = hermes.decode(rq.parse_completion({"messages": turn, "tools": [WEATHER]}, hermes, True).prompt)
    assert text.startswith("<|im_start|>system\n<tools>") and '"arguments": {"city": "Paris"' in text
    none = rq.parse_completion({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}, tok, True)
    assert "<tools>" not in tok.decode(none.prompt) and none.grammar is None


@pytest.mark.parametrize("name", list(FORMATS))
def test_calls_parse_whole_and_streamed_with_text_before(name):
    fmt = FORMATS[name]
    assert [c["name"] for c in fmt.parse(CALLS[name])[0]] == ["get_weather", "add"]
    req = ToolRequest((), "auto", None, True, fmt)
    lead = "" if name == "llama3_json" else "Sure. "  # Llama 3's calls are the whole output
    text, content, calls, splitter = lead + CALLS[name], "", [], ToolSplitter(req)
    for k in range(1, len(text) + 1):  # a character at a time: nothing of a call leaks into the content
        c, new = splitter.push(text[:k], final=k == len(text))
        content += c
        calls += new
    assert content == lead and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].arguments) == {"a": 1, "b": 2}


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_cut_or_broken_call_is_text_again(name):
    req = ToolRequest((), "auto", None, True, FORMATS[name])
    cut = CALLS[name][:40]
    assert ToolSplitter(req).push(cut, final=True) == (cut, [])
    broken = CALLS[name].replace('"a": 1', '"a": 1,,')
    content, calls = ToolSplitter(req).push(broken, final=True)
    assert [c.name for c in calls] == ["get_weather"] or content == broken  # a list stands or falls whole
    assert ToolSplitter(req).push("no calls here", final=True) == ("no calls here", [])


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_the_grammar_forces_calls_the_embedded_target_completes(tok, embedded, name, choice):
    """Greedy constrained decoding of the real target: its output parses into calls of the asked tools whose
    arguments validate against their schemas; a single call when parallel calls are off."""
    body = {"tools": [WEATHER, ADD], "tool_choice": "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False}
    req = tools_of(body, tok)
    req = ToolRequest(req.tools, req.choice, req.named, req.parallel, FORMATS[name])
    compiler = GrammarCompiler(tok, embedded.model.config.vocab_size, (tok.eos_token_id,))
    prompt = rq.chat_prompt(ASK, tok, None, req)
    out = reference_decode(embedded.model, prompt, SamplingParams(max_tokens=80), (tok.eos_token_id,),
                           compiler.state(req.grammar()))
    assert out[-1] == tok.eos_token_id, tok.decode(out)
    content, calls = ToolSplitter(req).push(tok.decode(out, skip_special_tokens=True), final=True)
    assert content == "" and len(calls) == 1
    schema = {t.name: t.parameters for t in req.tools}[calls[0].name]
    jsonschema.validate(json.loads(calls[0].arguments), schema)
    assert choice == "required" or calls[0].name == "get_weather"


def rounds_of(tok, text: str, finish: str = "stop"):
    ids = tok(text, add_special_tokens=False)["input_ids"]

    async def gen():
        for i in range(0, len(ids), 5):
            yield Round(ids[i:i + 5], finish if i + 5 >= len(ids) else None, {})
    return gen()


def test_responses_and_chunks_carry_the_calls(tok):
    req = rq.parse_completion({"messages": ASK, "tools": [WEATHER, ADD]}, tok, True)
    whole = asyncio.run(whole_response(texts(rounds_of(tok, CALLS["smollm2"]), tok, (), req.tools), req, "m", tok))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "add"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}

    async def chunks():
        return [json.loads(c[6:]) for c in [c async for c in sse(texts(rounds_of(tok, "Hi. " + CALLS["smollm2"]), tok,
                                                                    (), req.tools), req, "m", tok)][:-1]]
    got = asyncio.run(chunks())
    deltas = [c["choices"][0]["delta"] for c in got]
    assert "".join(d.get("content") or "" for d in deltas) == "Hi. "
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "add")]
    assert got[-1]["choices"][0]["finish_reason"] == "tool_calls"
    cut = asyncio.run(whole_response(texts(rounds_of(tok, CALLS["smollm2"][:50], "length"), tok, (), req.tools),
                                     req, "m", tok))["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == CALLS["smollm2"][:50]
