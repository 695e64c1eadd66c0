"""JSON schemas made exact for the grammar engine: keywords XGrammar 0.2.9 ignores or only approximates are a 400
naming the keyword and where it is; two it gets wrong are rewritten to what it gets right (docs/specdec.md,
"Grammars through trees"). Pure: no XGrammar, no torch."""

from __future__ import annotations

import copy

from specdec.errors import InvalidRequest

# ignored by the converter: an output could break them
IGNORED = ("if", "dependencies", "dependentRequired", "dependentSchemas", "not", "contains", "minContains",
           "maxContains", "propertyNames", "multipleOf", "unevaluatedProperties", "unevaluatedItems")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "additionalItems", "then", "else")
PRIMITIVE = {"string", "number", "integer", "boolean", "null", "array", "object"}


def exact_schema(schema, where: str = "json_schema") -> dict | bool:
    """``schema`` as XGrammar can follow it exactly (a copy), or InvalidRequest naming the keyword and its path."""
    out = copy.deepcopy(schema)
    try:
        _visit(out, "#", out)
    except _Refused as e:
        raise InvalidRequest(f"{where}: {e}") from None
    return out


class _Refused(Exception):
    pass


def _visit(s, path: str, root) -> None:
    if not isinstance(s, dict):
        return
    for key in IGNORED:
        if key in s and not (key == "multipleOf" and s.get("type") not in ("number", "integer")):
            _refuse(key, path, "is not enforced by the grammar engine")
    if s.get("uniqueItems") is True:
        _refuse("uniqueItems", path, "is not enforced by the grammar engine")
    if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
        _refuse("allOf", path, "with more than one schema is only approximated by the grammar engine")
    if isinstance(s.get("oneOf"), list) and len(s["oneOf"]) > 1 and not _disjoint(s["oneOf"], root):
        _refuse("oneOf", path, "with branches that may overlap is only approximated (as anyOf); use anyOf")
    _strings(s, path)
    _required(s, path)
    for key in SUBSCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            for name, sub in s[key].items():
                _visit(sub, f"{path}/{key}/{name}", root)
    for key in SUBSCHEMA_LISTS:
        if isinstance(s.get(key), list):
            for i, sub in enumerate(s[key]):
                _visit(sub, f"{path}/{key}/{i}", root)
    for key in SUBSCHEMAS:
        _visit(s.get(key), f"{path}/{key}", root)


def _refuse(key: str, path: str, why: str) -> None:
    raise _Refused(f"'{key}' at {path} {why}")


def _disjoint(branches: list, root) -> bool:
    """Whether no document can match two branches (local ``$ref`` s followed): their ``type`` s share no type
    (integer is a number), or each pins a property all of them require to values of its own (``const``/``enum``)."""
    branches = [_deref(b, root) for b in branches]
    types = [_types(b) for b in branches]
    if all(types) and sum(len(t) for t in types) == len(set().union(*types)):
        return True
    if not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in branches):
        return False
    shared = set.intersection(*(set(b.get("required", ())) for b in branches))
    for name in shared:
        pinned = [_values(b["properties"].get(name)) for b in branches]
        if all(p is not None for p in pinned) and sum(len(p) for p in pinned) == len(set().union(*pinned)):
            return True
    return False


def _deref(s, root, depth: int = 0):
    """A local ``{"$ref": "#/..."}`` resolved (a few hops); anything else as it is."""
    while isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#") and depth < 8:
        node = root
        for part in s["$ref"][1:].strip("/").split("/") if s["$ref"] != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        s, depth = node, depth + 1
    return s


def _types(s) -> set | None:
    """The JSON types a schema's ``type`` admits (number as integer and fraction), or None where it does not say."""
    t = s.get("type") if isinstance(s, dict) else None
    names = [t] if isinstance(t, str) else t if isinstance(t, list) else None
    if not names or not all(isinstance(n, str) and n in PRIMITIVE for n in names):
        return None
    return set().union(*({"integer", "fraction"} if n == "number" else {n} for n in names))


def _values(s) -> set | None:
    if isinstance(s, dict) and "const" in s:
        return {repr(s["const"])}
    if isinstance(s, dict) and isinstance(s.get("enum"), list):
        return {repr(v) for v in s["enum"]}
    return None


def _strings(s: dict, path: str) -> None:
    """``minLength``/``maxLength``: XGrammar 0.2.9 lets such a string hold raw control characters (invalid JSON) and
    drops the lengths next to a ``pattern``; without a pattern they become one: printable characters but for a
    quote and a backslash (a narrower, never invalid output)."""
    if "minLength" not in s and "maxLength" not in s:
        return
    if "pattern" in s or "format" in s:
        _refuse("maxLength" if "maxLength" in s else "minLength", path,
                "next to 'pattern' or 'format' is not enforced by the grammar engine")
    lo, hi = s.pop("minLength", 0), s.pop("maxLength", "")
    s["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{lo},{hi}}}$'


def _required(s: dict, path: str) -> None:
    """A required name missing from ``properties``: XGrammar drops it; it is added, with the schema
    ``additionalProperties`` gives it, or refused where no such property may exist."""
    required = s.get("required")
    if not isinstance(required, list):
        return
    props = s.setdefault("properties", {}) if isinstance(s.get("properties", {}), dict) else None
    missing = [r for r in required if isinstance(r, str) and props is not None and r not in props]
    if not missing:
        return
    extra = s.get("additionalProperties", {})
    if extra is False or s.get("patternProperties"):
        _refuse("required", path, f"names {missing[0]!r}, which 'properties' does not define")
    for name in missing:
        props[name] = extra if isinstance(extra, dict) else {}
