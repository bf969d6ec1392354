"""Which constraint a request asks for, from the fields clients send (model-free checks).

The documented spelling is `response_format` (OpenAI: `json_object`, `json_schema`) and, for
what OpenAI has no field for, `structured_outputs` (`{"json" | "regex" | "choice" | "grammar":
...}` or `{"json_object": true}`); vLLM's older `guided_json`, `guided_regex`, `guided_choice`
and `guided_grammar` are accepted as aliases. One constraint per request. Whether the schema,
regex or grammar itself is valid needs the grammar engine: `Frontend.prepare` compiles it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cluster.protocol.errors import ProtocolError
from workers.structured import spec as s

_STRUCTURED_KEYS = {"json": s.JSON_SCHEMA, "regex": s.REGEX, "choice": s.CHOICE,
                    "grammar": s.GRAMMAR, "json_object": s.JSON_OBJECT}
_ALIASES = {"guided_json": s.JSON_SCHEMA, "guided_regex": s.REGEX,
            "guided_choice": s.CHOICE, "guided_grammar": s.GRAMMAR}


@dataclass(frozen=True)
class GrammarRequest:
    kind: str
    text: str
    param: str  # the field it came from, for errors


def _bad(param: str, message: str) -> ProtocolError:
    return ProtocolError(400, f"'{param}' {message}", param=param)


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(param, "must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(value, dict):
        raise _bad(param, "must be a JSON schema (an object)")
    return s.canonical_json(value)


def _text_of(kind: str, value: Any, param: str) -> str:
    if kind == s.JSON_SCHEMA:
        return _schema_text(value, param)
    if kind == s.JSON_OBJECT:
        if value is not True:
            raise _bad(param, "must be true")
        return ""
    if kind == s.CHOICE:
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c
                                                         for c in value)):
            raise _bad(param, "must be a non-empty list of non-empty strings")
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise _bad(param, "must be a non-empty string")
    return value


def _from_response_format(value: dict[str, Any]) -> GrammarRequest | None:
    param = "response_format"
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarRequest(s.JSON_OBJECT, "", param)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            # OpenAI nests {"name", "schema", "strict"} under "json_schema".
            raise _bad(param, "of type 'json_schema' needs 'json_schema': {'name': ..., "
                       "'schema': {...}}")
        schema = inner["schema"]
        return GrammarRequest(s.JSON_SCHEMA, _schema_text(schema, f"{param}.json_schema.schema"),
                              param)
    raise _bad(param, f"has an unsupported type {kind!r}: 'text', 'json_object' or "
               "'json_schema'")


def grammar_request(response_format: Any, structured_outputs: Any,
                    aliases: dict[str, Any]) -> GrammarRequest | None:
    """The one constraint the fields ask for, or None; 400 when several are given."""
    found: list[GrammarRequest] = []
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise _bad("response_format", "must be an object")
        grammar = _from_response_format(response_format)
        if grammar is not None:
            found.append(grammar)
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise _bad("structured_outputs", "must be an object")
        for key, value in structured_outputs.items():
            if value is None or value is False:
                continue
            if key not in _STRUCTURED_KEYS:
                raise _bad("structured_outputs", f"has an unknown key {key!r}: one of "
                           f"{sorted(_STRUCTURED_KEYS)}")
            kind = _STRUCTURED_KEYS[key]
            param = f"structured_outputs.{key}"
            found.append(GrammarRequest(kind, _text_of(kind, value, param), param))
    for name, value in aliases.items():
        if value is not None:
            kind = _ALIASES[name]
            found.append(GrammarRequest(kind, _text_of(kind, value, name), name))
    if len(found) > 1:
        names = ", ".join(f"'{g.param}'" for g in found)
        raise ProtocolError(400, f"only one output constraint per request, got {names}",
                            param=found[1].param)
    return found[0] if found else None
