"""`StructuredOutputsParams`: what a request's output must match (vLLM's names and semantics).

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))

Exactly one of five kinds, each a way to write a grammar:

    json         a JSON Schema (a dict, or its JSON text): the output is one JSON value valid against it
    json_object  True: any JSON object (OpenAI's `response_format={"type": "json_object"}`)
    regex        a regular expression the whole output must match
    choice       a list of strings: the output is exactly one of them
    grammar      a context-free grammar in Lark syntax (llguidance's), or GBNF (llama.cpp's, which
                 vLLM users send as "EBNF"): told apart by `::=`

This module only checks the shape of the request (one kind, the right types). Whether the schema,
the regex or the grammar is valid is found when it is compiled, at the engine's boundary
(engine/grammar.py), where an invalid one raises `ValueError` before the request is queued.

`spec` is the kind's value as one string (a schema as compact JSON, its keys in order), which keys the compiled-grammar
cache: two requests with the same schema compile it once.

Strict schemas (`strict_schema`, applied by the engine when `EngineConfig.strict_json_schema`, the default): an
object schema that names its `properties` and says nothing of `additionalProperties` allows no other property,
as vLLM's default backend (xgrammar) compiles it. JSON Schema itself allows any unnamed property there, and a
small model asked for `{"city": ...}` then writes keys of its own until `max_tokens` runs out. A request's own
`strict` (a tool's `function.strict`, a response_format json_schema's `strict`) decides for its schema
(`with_strictness`): true closes it, false leaves it open (`loose_schema`), absent follows the engine.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 200_000  # a schema, regex or grammar this long is refused (its compilation grows with it)
# Keywords whose value is one subschema, a list of them, or a map of names to them (JSON Schema 2020-12 and draft 7).
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
               "unevaluatedItems", "unevaluatedProperties", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")  # draft 7's tuple form of items is a list
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class StructuredOutputKind(enum.Enum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in StructuredOutputKind if getattr(self, k.value) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(k.value for k in StructuredOutputKind)
            raise ValueError(f"StructuredOutputsParams needs exactly one of {names}; got "
                             f"{', '.join(k.value for k in given) or 'none'}")
        kind = given[0]
        value = getattr(self, kind.value)
        if kind is StructuredOutputKind.JSON:
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
            else:
                parsed = value
            if not isinstance(parsed, dict):
                raise ValueError("StructuredOutputsParams.json must be a JSON Schema: an object (a dict, or its "
                                 f"JSON text), got {type(parsed).__name__}")
        elif kind is StructuredOutputKind.JSON_OBJECT and value is not True:
            raise ValueError(f"StructuredOutputsParams.json_object must be True, got {value!r}")
        elif kind in (StructuredOutputKind.REGEX, StructuredOutputKind.GRAMMAR) and \
                (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"StructuredOutputsParams.{kind.value} must be a non-empty string, got {value!r}")
        elif kind is StructuredOutputKind.CHOICE:
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value or \
                    any(not isinstance(c, str) or not c for c in value):
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings, "
                                 f"got {value!r}")
            object.__setattr__(self, "choice", list(value))
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"StructuredOutputsParams.{kind.value} is {len(self.spec)} characters; give at most "
                             f"{MAX_SPEC_CHARS}")

    @property
    def kind(self) -> StructuredOutputKind:
        return next(k for k in StructuredOutputKind if getattr(self, k.value) not in (None, False))

    @property
    def spec(self) -> str:
        """The kind's value as one string: what the grammar is compiled from, and its cache key."""
        kind = self.kind
        value = getattr(self, kind.value)
        if kind is StructuredOutputKind.JSON:
            parsed = json.loads(value) if isinstance(value, str) else value
            return json.dumps(parsed, separators=(",", ":"))  # key order kept: properties come in schema order
        if kind is StructuredOutputKind.CHOICE:
            return json.dumps(value)
        if kind is StructuredOutputKind.JSON_OBJECT:
            return ""
        return value

    @classmethod
    def from_dict(cls, body: dict[str, Any], where: str = "structured_outputs") -> "StructuredOutputsParams":
        """From a request body's `structured_outputs` object (the server): unknown keys are refused, named."""
        if not isinstance(body, dict):
            raise ValueError(f"{where} must be an object with one of json, regex, choice, grammar, json_object")
        known = {k.value for k in StructuredOutputKind}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"{where}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not supported; "
                             f"use one of {', '.join(sorted(known))}")
        return cls(**body)


def strict_schema(schema: Any, *, member_of_all_of: bool = False) -> Any:
    """A copy of `schema` in which every object schema with `properties` and neither `additionalProperties`
    nor `unevaluatedProperties` gets `additionalProperties: false`, at every depth ($defs, items, anyOf, ...).
    Members of an `allOf` are left open at their own level: each names only its share of the properties, so
    closing them would forbid what the others name. Anything that is not a schema object comes back as it is."""
    return _pin_additional_properties(schema, False, member_of_all_of)


def loose_schema(schema: Any) -> Any:
    """The opposite pin: `additionalProperties: true` where `strict_schema` would write false, so the engine's
    strict default leaves the schema open (a tool that says `"strict": false`: JSON Schema's own rule)."""
    return _pin_additional_properties(schema, True, False)


def with_strictness(schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    """A schema as a request's `strict` asks: True closed, False open, None as the engine's
    `strict_json_schema` says. ValueError (not RecursionError) for one nested too deeply to rewrite."""
    if strict is None:
        return schema
    try:
        return strict_schema(schema) if strict else loose_schema(schema)
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None


def _pin_additional_properties(schema: Any, value: bool, member_of_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if (isinstance(out.get("properties"), dict) and not member_of_all_of
            and "additionalProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = value
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _pin_additional_properties(out[key], value, False)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_pin_additional_properties(s, value, False) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_pin_additional_properties(s, value, True) for s in out["allOf"]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _pin_additional_properties(s, value, False) for name, s in out[key].items()}
    return out
