"""specdec/schema_support.py: what XGrammar would ignore or approximate is a 400 naming the keyword and where;
what it gets wrong is rewritten; real-world schemas (JSONSchemaBench) either refused or followed exactly."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from specdec.errors import InvalidRequest
from specdec.grammar import GrammarCompiler, GrammarSpec
from specdec.model.loading import load_tokenizer
from specdec.reference import reference_decode
from specdec.sampling import SamplingParams
from specdec.schema_support import exact_schema

DATA = Path(__file__).parent / "data" / "jsonschemabench"


@pytest.mark.parametrize("schema,words", [
    ({"if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if' at #"),
    ({"properties": {"x": {"type": "array", "uniqueItems": True}}}, "'uniqueItems' at #/properties/x"),
    ({"items": {"not": {"type": "string"}}}, "'not' at #/items"),
    ({"allOf": [{"required": ["a"]}, {"required": ["b"]}]}, "'allOf' at #"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}, "'oneOf' at #"),
    ({"type": "integer", "multipleOf": 3}, "'multipleOf' at #"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 4}, "'maxLength' at #"),
    ({"required": ["ghost"], "additionalProperties": False}, "'required' at #"),
    ({"$defs": {"d": {"dependentRequired": {"a": ["b"]}}}}, "'dependentRequired' at #/$defs/d"),
])
def test_what_the_engine_would_not_enforce_is_refused_by_name(schema, words):
    with pytest.raises(InvalidRequest, match=words.replace("$", r"\$")):
        exact_schema(schema)


def test_rewrites_and_what_passes_unchanged():
    assert exact_schema({"required": ["a", "b"], "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
                        )["properties"]["b"] == {"type": "integer"}
    assert exact_schema({"type": "string", "minLength": 2})["pattern"] == '^[^\\x00-\\x1f"\\\\]{2,}$'
    ok = [{"oneOf": [{"type": "string"}, {"type": "null"}]},  # disjoint by type
          {"oneOf": [{"properties": {"k": {"const": 1}}, "required": ["k"]},
                     {"properties": {"k": {"enum": [2, 3]}}, "required": ["k"]}]},  # disjoint by a pinned property
          {"allOf": [{"type": "object"}]}, {"type": "array", "uniqueItems": False}, {"type": "string", "format": "date"}]
    for schema in ok:
        assert exact_schema(schema) == schema


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return GrammarCompiler(load_tokenizer("embedded"), tiny_model.config.vocab_size, (0,))


def test_a_short_strings_output_is_valid_json_of_its_length(tiny_model, compiler):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
              "required": ["s"]}
    tok = load_tokenizer("embedded")
    for seed in range(4):
        out = reference_decode(tiny_model, [5 + seed, 9, 31], SamplingParams(max_tokens=40, temperature=1.0, seed=seed),
                               (0,), compiler.state(GrammarSpec("json_schema", json.dumps(schema))))
        if out[-1] == 0:
            jsonschema.validate(json.loads(tok.decode(out[:-1])), schema)


@pytest.mark.parametrize("path", sorted(DATA.glob("*/*.json")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_real_world_schemas_are_refused_by_name_or_followed_exactly(tiny_model, compiler, path):
    """Each either a 400 naming its keyword, or a constrained output (random target, sampled) that, once
    complete, validates; five of these did not validate before (XGrammar's oneOf, if and dropped 'required')."""
    schema = json.loads(path.read_text())
    try:
        state = compiler.state(GrammarSpec("json_schema", json.dumps(schema)))
    except InvalidRequest as e:
        assert "' at #" in e.message
        return
    tok = load_tokenizer("embedded")
    for seed in range(2):
        out = reference_decode(tiny_model, [7, 9, 31 + seed], SamplingParams(max_tokens=120, temperature=1.0,
                                                                             seed=seed), (0,), state)
        if out[-1] == 0:
            jsonschema.validate(json.loads(tok.decode(out[:-1])), schema)
        state = compiler.state(GrammarSpec("json_schema", json.dumps(schema)))


def test_oneof_branches_disjoint_by_type_through_refs_and_type_lists():
    defs = {"$defs": {"s": {"type": "string"}, "n": {"type": ["null", "boolean"]}, "i": {"type": "integer"}}}
    ok = {**defs, "oneOf": [{"$ref": "#/$defs/s"}, {"$ref": "#/$defs/n"}, {"type": "array"}]}
    assert exact_schema(ok) == ok
    for overlapping in ([{"$ref": "#/$defs/i"}, {"type": "number"}], [{"$ref": "#/$defs/n"}, {"type": "boolean"}],
                        [{"type": "string"}, {"type": "string", "format": "uri"}]):
        with pytest.raises(InvalidRequest, match="'oneOf' at #"):
            exact_schema({**defs, "oneOf": overlapping})
