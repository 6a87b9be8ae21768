"""JSON schemas as xgrammar 0.2.8 enforces them: refused keywords, bounded strings rewritten.

Run on every `json_schema` guide (and every json_schema content of a structural tag) when `guided.GuideCompiler`
compiles it, so every entry point (the ensemble's guided_decoding_guide, the OpenAI front end, in-process callers)
gets the same schema semantics; the OpenAI front end calls the same functions to answer 400 before it sends.

- Keywords xgrammar 0.2.8 compiles without enforcing (`UNENFORCED`, and `allOf` with several subschemas, and
  `minLength` / `maxLength` beside `pattern` or `format`, where it drops the lengths; each checked against the
  library in tests/test_openai_structured.py by compiling it with a document that breaks it) are refused, naming
  the keyword and where it is (`keyword at #/properties/x`), as vLLM refuses them for xgrammar: an answer that
  looks constrained but can break the schema would be worse than an error. `oneOf` is accepted: xgrammar enforces
  disjoint branches exactly and reads overlapping ones as `anyOf`.
- xgrammar compiles a string's `minLength` / `maxLength` to "any characters but `"`, `\\` and newlines", which lets
  raw control characters into the string (invalid JSON; seen live: `"tag": "( red\x1f"`). Such a string with
  bounds up to `PATTERN_MAX_LENGTH` is compiled as the equivalent `pattern` `^[^"\\\x00-\x1f]{min,max}$`
  (`string_lengths_as_patterns`): the same lengths, no control characters; the answers are a subset of the
  schema's (no escape sequences). Longer bounds keep xgrammar's own lengths: as a pattern, every decode step's
  token-mask fill inside the string costs 20-40 ms from `maxLength` 256 on (vs 3-85 us natively; 8,192-token
  vocabulary, docs/performance.md), on the engine's thread, for every guided row; the price is that such a
  string may hold raw control characters.
"""
from __future__ import annotations

import json
from typing import Any, Optional

# Schema keywords xgrammar compiles without enforcing (allOf: only with one subschema)
UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems",
              "contains", "minContains", "maxContains", "unevaluatedItems")
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_ONE = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "contains", "not", "if",
            "then", "else")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


class UnenforcedKeyword(ValueError):
    """A schema keyword the library would not enforce; str() is `'keyword' at #/path`."""


def unenforced_keyword(schema: Any, path: str = "#") -> Optional[str]:
    """The first keyword of `schema` (or its subschemas) that the library would not enforce, as `keyword at
    path`; None when there is none."""
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return f"{key!r} at {path}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' with {len(schema['allOf'])} subschemas at {path}"
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    with_ = [k for k in ("pattern", "format") if k in schema]
    if lengths and with_:
        return f"{lengths[0]!r} beside {with_[0]!r} at {path}"
    subs = [(f"{path}/{k}/{name}", v) for k in _SUB_MAPS if isinstance(schema.get(k), dict)
            for name, v in schema[k].items()]
    subs += [(f"{path}/{k}", schema[k]) for k in _SUB_ONE if k in schema]
    subs += [(f"{path}/{k}/{i}", v) for k in _SUB_LISTS if isinstance(schema.get(k), list)
             for i, v in enumerate(schema[k])]
    for where, sub in subs:
        found = unenforced_keyword(sub, where)
        if found:
            return found
    return None


def _is_string(schema: dict) -> bool:
    t = schema.get("type")
    return t == "string" or (isinstance(t, list) and "string" in t)


PATTERN_MAX_LENGTH = 64  # string bounds rewritten as patterns up to this (see the module doc)


def _short(schema: dict) -> bool:
    bounds = [schema.get(k) for k in ("minLength", "maxLength") if k in schema]
    return all(isinstance(b, int) and b <= PATTERN_MAX_LENGTH for b in bounds)


def string_lengths_as_patterns(schema: Any) -> Any:
    """A copy of `schema` where each string's minLength / maxLength (up to PATTERN_MAX_LENGTH) is the equivalent
    pattern without control characters, quotes or backslashes (see the module's doc). Idempotent."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUB_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: string_lengths_as_patterns(v) for name, v in out[k].items()}
    for k in _SUB_ONE:
        if k in out:
            out[k] = string_lengths_as_patterns(out[k])
    for k in _SUB_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [string_lengths_as_patterns(v) for v in out[k]]
    if _is_string(out) and ("minLength" in out or "maxLength" in out) and "pattern" not in out \
            and "format" not in out and _short(out):
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = '^[^"\\\\\\x00-\\x1f]{%d,%s}$' % (low, "" if high is None else int(high))
    return out


def enforceable(schema: Any) -> Any:
    """The schema xgrammar is given: refused (`UnenforcedKeyword`) when it holds a keyword the library would not
    enforce, else with its bounded strings as patterns."""
    found = unenforced_keyword(schema)
    if found:
        raise UnenforcedKeyword(found)
    return string_lengths_as_patterns(schema)


def enforceable_text(text: str) -> str:
    """`enforceable` of a schema's JSON text (text that is not JSON is returned as it is: the library's parser
    names what is wrong with it)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(enforceable(schema), ensure_ascii=False)


def enforceable_tag(node: Any) -> Any:
    """A structural tag (parsed) with each `{"json_schema": S}` content's S `enforceable`."""
    if isinstance(node, list):
        return [enforceable_tag(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: enforceable_tag(v) for k, v in node.items() if k != "json_schema"}
    if "json_schema" in node:
        out["json_schema"] = enforceable(node["json_schema"])
    return out
