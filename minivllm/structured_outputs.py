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
(engine/structured_output/grammar.py), where an invalid one raises `ValueError` before the request is queued.

`spec` is the kind's value as one string (a schema as compact JSON, its keys in order), which keys the compiled-grammar
cache: two requests with the same schema compile it once.

Strict schemas (schema_strictness.py, applied by the engine when `EngineConfig.strict_json_schema`, the
default): a self-contained object schema that names its `properties` and says nothing of `additionalProperties`
allows no other property, as vLLM's default backend (xgrammar) compiles it. A request's own `strict` (a tool's
`function.strict`, a response_format json_schema's `strict`) decides for its schema: true closes it, false
leaves it open, absent follows the engine.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 200_000  # a schema, regex or grammar this long is refused (its compilation grows with it)
# Levels of JSON nesting (objects and arrays) a schema may have. Every pass over a schema recurses once a level or
# more (json.dumps, the strict rewrite, llguidance's conversion) within Python's 1,000 frames, so a deeper one
# escaped as a RecursionError (a 500) instead of a refusal. Real schemas are shallow (pydantic names each model
# once in $defs): 128 levels are about 60 levels of nested objects, far below the frames the passes need.
MAX_SCHEMA_DEPTH = 128


_TOO_DEEP = f"nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep; flatten it (name a repeated " \
            "object once in $defs and $ref it)"


def check_schema_size(schema: Any, where: str) -> None:
    """ValueError naming `where` for a schema nested more than MAX_SCHEMA_DEPTH levels, or with more values than
    MAX_SPEC_CHARS allows characters. Iterative (a stack, no recursion): it is what makes the recursive passes
    after it safe."""
    stack, seen = [(schema, 1)], 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > MAX_SPEC_CHARS:  # every value takes a character or more: over the size cap whatever its text
            raise ValueError(f"{where} has more than {MAX_SPEC_CHARS} values; give at most {MAX_SPEC_CHARS} characters")
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{where} {_TOO_DEEP}")
        stack.extend((c, depth + 1) for c in (value.values() if isinstance(value, dict) else value))


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
                except RecursionError:  # json's own decoder recurses once a level
                    raise ValueError(f"StructuredOutputsParams.json {_TOO_DEEP}") from None
            else:
                parsed = value
            if not isinstance(parsed, dict):
                raise ValueError("StructuredOutputsParams.json must be a JSON Schema: an object (a dict, or its "
                                 f"JSON text), got {type(parsed).__name__}")
            check_schema_size(parsed, "StructuredOutputsParams.json")
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
