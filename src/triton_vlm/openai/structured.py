"""Structured outputs: a request's constraint -> the ensemble's `guided_decoding_guide_type` /
`guided_decoding_guide` inputs (TensorRT-LLM's names; the engine compiles the guide with xgrammar and masks every
sampled token, every beam included, so each returned text is in the constraint's language).

| request | guide_type | guide |
|---|---|---|
| `response_format: {"type": "json_object"}`, `structured_outputs.json_object` | `json` | "" (any JSON object) |
| `response_format: {"type": "json_schema", "json_schema": {"schema": S}}` (`strict` accepted) | `json_schema` | S |
| `structured_outputs.json` / `guided_json` (a schema, as an object or as JSON text) | `json_schema` | the schema |
| `structured_outputs.regex` / `guided_regex` | `regex` | the pattern |
| `structured_outputs.choice` / `guided_choice` (a list of strings) | `choice` | the list as JSON |
| `structured_outputs.grammar` / `guided_grammar` (EBNF, xgrammar's dialect) | `ebnf_grammar` | the grammar |
| `response_format: {"type": "structural_tag", ...}`, `structured_outputs.structural_tag` | `structural_tag` | below |
| `tool_choice` `required` / a named function (`tools.py`) | `json_schema` | the tools' schema |

A structural tag is xgrammar's (`{"type": "structural_tag", "format": {...}}`), sent as it is; vLLM's older
form (`structures` of `begin` / `schema` / `end`, and `triggers`) is rewritten to it (`triggered_tags`), since
the library no longer compiles that form. `response_format: {"type": "text"}` is no constraint. One constraint
per request: several -> 400 naming them.
What only the library can judge (an invalid schema or regex) comes back from the engine as INVALID_ARG with
xgrammar's message: a 400 with that message (`errors.from_triton`). The engine refuses the keywords xgrammar
0.2.8 does not enforce and compiles bounded strings as control-character-free patterns
(`engine.guided_schema`, up to maxLength 64, for every entry point); this module calls the same functions first, so an OpenAI
client gets a 400 naming the keyword and where it is (code `unsupported_schema_keyword`) before anything is
sent, and sends the rewritten schema. `oneOf` is accepted (xgrammar enforces disjoint branches).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from .. import names as N
from ..engine.search.guided_schema import UNENFORCED, string_lengths_as_patterns, unenforced_keyword  # noqa: F401
from .errors import bad_request
from .schemas import (JSONObjectFormat, JSONSchemaResponseFormat, StructuralTagFormat, StructuredOutputs,
                      _Structured)



@dataclass(frozen=True)
class Guide:
    """One constraint: the ensemble's guide type and guide, and the request field it came from (for errors)."""

    type: str  # one of names.GUIDE_TYPES
    guide: str
    source: str

    def inputs(self) -> dict[str, str]:
        return {N.GUIDED_DECODING_GUIDE_TYPE: self.type, N.GUIDED_DECODING_GUIDE: self.guide}


def check_schema(schema: Any, where: str) -> None:
    found = unenforced_keyword(schema)
    if found:
        raise bad_request(f"{where}: the JSON schema keyword {found} is not supported (xgrammar, the structured-"
                          "output library, does not enforce it)", param=where.split(".")[0],
                          code="unsupported_schema_keyword")


def _schema_text(value: Union[str, dict, bool], where: str) -> str:
    """A JSON schema given as an object or as JSON text -> its JSON text (checked to be JSON: the library checks
    that it is a schema)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{where} is not valid JSON: {e}", param=where.split(".")[0]) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{where} must be a JSON schema (an object), got {type(value).__name__}",
                          param=where.split(".")[0])
    check_schema(value, where)
    return json.dumps(string_lengths_as_patterns(value), ensure_ascii=False)


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise bad_request(f"{where} is not valid JSON: {e}", param=where.split(".")[0]) from None


def structural_tag(tag: Any, where: str) -> str:
    """A structural tag as xgrammar compiles it: vLLM's older `structures` + `triggers` form rewritten to a
    `triggered_tags` format (each structure's schema checked and sent as for json_schema)."""
    if not isinstance(tag, dict):
        raise bad_request(f"{where} must be a JSON object", param=where.split(".")[0])
    if "structures" in tag and "format" not in tag:
        tags = []
        for k, item in enumerate(tag["structures"] if isinstance(tag["structures"], list) else []):
            if not isinstance(item, dict) or not {"begin", "schema", "end"} <= item.keys():
                raise bad_request(f"{where}.structures[{k}] needs begin, schema and end",
                                  param=where.split(".")[0])
            tags.append({"begin": item["begin"], "end": item["end"],
                         "content": {"type": "json_schema", "json_schema": item["schema"]}})
        tag = {"type": "structural_tag",
               "format": {"type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}}
    return json.dumps(_tag_schemas(tag, where), ensure_ascii=False)


def _tag_schemas(node: Any, where: str) -> Any:
    """A structural tag with each `{"type": "json_schema", "json_schema": S}` checked and S sent as for
    json_schema (string lengths as patterns)."""
    if isinstance(node, list):
        return [_tag_schemas(x, where) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _tag_schemas(v, where) for k, v in node.items() if k != "json_schema"}
    if "json_schema" in node:
        check_schema(node["json_schema"], f"{where} (a json_schema content)")
        out["json_schema"] = string_lengths_as_patterns(node["json_schema"])
    return out


def _choice(value: list[str], where: str) -> str:
    if not value:
        raise bad_request(f"{where} must list at least one string", param=where.split(".")[0])
    return json.dumps(value, ensure_ascii=False)


def _text(value: str, where: str) -> str:
    if not value:
        raise bad_request(f"{where} is empty", param=where.split(".")[0])
    return value


def _from_response_format(fmt) -> Optional[Guide]:
    if isinstance(fmt, JSONObjectFormat):
        return Guide("json", "", "response_format")
    if isinstance(fmt, JSONSchemaResponseFormat):
        schema = fmt.json_schema.schema_
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required for type json_schema",
                              param="response_format")
        return Guide("json_schema", _schema_text(schema, "response_format.json_schema.schema"), "response_format")
    if isinstance(fmt, StructuralTagFormat):
        return Guide("structural_tag", structural_tag(fmt.model_dump(), "response_format"), "response_format")
    return None  # {"type": "text"}


def _from_structured_outputs(so: StructuredOutputs) -> list[Guide]:
    where, out = "structured_outputs", []
    if so.json_ is not None:
        out.append(Guide("json_schema", _schema_text(so.json_, f"{where}.json"), f"{where}.json"))
    if so.regex is not None:
        out.append(Guide("regex", _text(so.regex, f"{where}.regex"), f"{where}.regex"))
    if so.choice is not None:
        out.append(Guide("choice", _choice(so.choice, f"{where}.choice"), f"{where}.choice"))
    if so.grammar is not None:
        out.append(Guide("ebnf_grammar", _text(so.grammar, f"{where}.grammar"), f"{where}.grammar"))
    if so.json_object:
        out.append(Guide("json", "", f"{where}.json_object"))
    if so.structural_tag is not None:
        tag = f"{where}.structural_tag"
        out.append(Guide("structural_tag", structural_tag(_json(_text(so.structural_tag, tag), tag), tag), tag))
    return out


def _from_guided(body: _Structured) -> list[Guide]:
    out = []
    if body.guided_json is not None:
        out.append(Guide("json_schema", _schema_text(body.guided_json, "guided_json"), "guided_json"))
    if body.guided_regex is not None:
        out.append(Guide("regex", _text(body.guided_regex, "guided_regex"), "guided_regex"))
    if body.guided_choice is not None:
        out.append(Guide("choice", _choice(body.guided_choice, "guided_choice"), "guided_choice"))
    if body.guided_grammar is not None:
        out.append(Guide("ebnf_grammar", _text(body.guided_grammar, "guided_grammar"), "guided_grammar"))
    return out


def request_guide(body: _Structured, tool_guide: Optional[Guide] = None) -> Optional[Guide]:
    """The request's one constraint, or None; 400 naming them when it sets several."""
    guides = []
    if body.response_format is not None:
        g = _from_response_format(body.response_format)
        if g is not None:
            guides.append(g)
    if body.structured_outputs is not None:
        guides += _from_structured_outputs(body.structured_outputs)
    guides += _from_guided(body)
    if tool_guide is not None:
        guides.append(tool_guide)
    if len(guides) > 1:
        names = ", ".join(g.source for g in guides)
        raise bad_request(f"one structured output constraint per request, got {len(guides)}: {names}",
                          param=guides[1].source.split(".")[0])
    return guides[0] if guides else None


def apply(inputs: dict[str, Any], guide: Optional[Guide]) -> None:
    """Add the guide's ensemble inputs to a plan's inputs."""
    if guide is not None:
        inputs.update(guide.inputs())
