"""A request's structured-output fields (OpenAI's `response_format`, vLLM's `structured_outputs`) as one
`StructuredOutputsParams`.

    response_format {"type": "text"}                                   nothing asked
    response_format {"type": "json_object"}                            any JSON object
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}
                                                                       JSON valid against "schema" (strict:
                                                                       false leaves it open, true closes it,
                                                                       absent: the engine's default)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
                                                                       vLLM's (the openai client sends it
                                                                       in extra_body); one key, as in Python

Both on one request is a 400: they would be two constraints on one output. vLLM's removed `guided_*`
fields are refused (field_policy.py) with a message that names `structured_outputs`. Whether a schema,
regex or grammar is valid is found when the engine compiles it, before the request is queued (a 400
naming the field sent: `structured_outputs`, or `response_format.json_schema.schema`: preprocess.py).
"""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.field_policy import RequestError
from minivllm.schema_strictness import with_strictness
from minivllm.structured_outputs import StructuredOutputsParams, check_schema_size

_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def structured_outputs_params(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                              tool_constraint: StructuredOutputsParams | None = None
                              ) -> StructuredOutputsParams | None:
    """Raises RequestError naming the field at fault. `tool_constraint`: what a "required" or named
    tool_choice constrains the output to (tool_calls.py), which excludes the other two."""
    if tool_constraint is not None:
        if response_format not in (None, {"type": "text"}) or structured_outputs is not None:
            raise RequestError("tool_choice", "a required or named tool_choice constrains the output already; "
                                              "leave out response_format / structured_outputs, or use auto")
        return tool_constraint
    from_format = _from_response_format(response_format) if response_format is not None else None
    if structured_outputs is not None:
        if from_format is not None:
            raise RequestError("structured_outputs", "cannot be combined with a response_format other than "
                                                     "text; send one of the two")
        try:
            return StructuredOutputsParams.from_dict(structured_outputs)
        except (TypeError, ValueError) as e:
            raise RequestError("structured_outputs", str(e)) from None
        except RecursionError:  # StructuredOutputsParams caps a schema's depth; a backstop, never a 500
            raise RequestError("structured_outputs", "is nested too deeply") from None
    return from_format


def _from_response_format(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise RequestError("response_format", f"type {kind!r} is not supported; use text, json_object or json_schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise RequestError("response_format.json_schema", "must be an object with a name (and a schema)")
    unknown = sorted(set(spec) - _SCHEMA_KEYS)
    if unknown:
        raise RequestError("response_format.json_schema", f"{', '.join(unknown)} not supported; use "
                                                          f"{', '.join(sorted(_SCHEMA_KEYS))}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError("response_format.json_schema.schema", "must be a JSON Schema (an object)")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError("response_format.json_schema.strict", f"must be true or false, got {strict!r}")
    try:
        check_schema_size(schema, "the schema")  # before the strict rewrite, which recurses once a level
        return StructuredOutputsParams(json=with_strictness(schema, strict))
    except ValueError as e:  # the schema's own fault: named as the field the client sent
        raise RequestError("response_format.json_schema.schema",
                           str(e).removeprefix("StructuredOutputsParams.json ")) from None
