"""Strict JSON schemas: which object schemas may be closed (`additionalProperties: false`) without refusing a
valid output.

    strict_schema(schema)           closed where it is safe (EngineConfig.strict_json_schema, the default)
    loose_schema(schema)            `additionalProperties: true` at the same places (a request's `strict: false`)
    with_strictness(schema, strict) as a request's own `strict` asks (None: the engine decides)

Why close at all: JSON Schema allows any property an object schema does not name, and a small model asked for
`{"city": ...}` then writes keys of its own until `max_tokens` runs out; vLLM's default backend (xgrammar)
compiles such a schema closed. Why not everywhere: a schema that shares its instance with another one names
only its share of the properties. Closing either one forbids what the other names:

    {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"b": ...}}]}      Base names "a", the member "b"
    {"properties": {"a": ...}, "anyOf": [{"properties": {"b": ...}}, ...]}  the parent names "a", each branch more

So an object schema is closed only when it is self-contained: it names `properties`, says nothing of
`additionalProperties` / `unevaluatedProperties`, has no `$ref` beside them and no composition of its own
(allOf, anyOf, oneOf, not, if/then/else, dependentSchemas), and its instance is its alone. An instance is shared
by the members of a composition (allOf, if/then/else, not, dependentSchemas; anyOf / oneOf unless the schema
holding them says nothing else: `{"anyOf": [{...}, {"type": "null"}]}`, pydantic's Optional, is a choice), by a
`$ref` and the keywords beside it, and so by whatever a `$ref` in a shared place points at ($defs targets
included, followed through chains of refs). A `$ref` this module cannot resolve (not a `#/...` pointer) in a
shared place leaves the whole schema open. When in doubt it stays open: the strictness is a default that
helps small models, and a wrong closure is a 400 on a valid schema.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple
from urllib.parse import unquote

# Keywords whose value is one subschema, a list of them, or a map of names to them (JSON Schema 2020-12 and draft 7),
# split by whether the subschema validates the same instance as the schema holding it ("shared") or another one.
_OTHER_ONE = ("items", "additionalItems", "contains", "additionalProperties", "unevaluatedItems",
              "unevaluatedProperties", "propertyNames")
_SHARED_ONE = ("not", "if", "then", "else")
_OTHER_LISTS = ("prefixItems", "items")  # draft 7's tuple form of items is a list
_CHOICES = ("anyOf", "oneOf")
_OTHER_MAPS = ("properties", "patternProperties")
_SHARED_MAPS = ("dependentSchemas", "dependencies")  # draft 7's dependencies: a schema, or a list of names
_DEFINITIONS = ("$defs", "definitions")
_COMPOSING = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "dependencies")
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")
# Keywords that say nothing about which properties an object may have: beside a composition or a $ref, they
# leave its members (its target) the only schemas of their instance.
_QUIET = frozenset({"type", "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                    "writeOnly", "nullable", "discriminator", "$schema", *_DEFINITIONS})
Pointer = tuple[str, ...]  # a subschema's place from the root: ("$defs", "Base"), ("properties", "a", "anyOf", "0")


class _Node(NamedTuple):
    schema: dict[str, Any]
    at: Pointer
    shared: bool  # its instance is also validated by a schema beside it (see the module docstring)


class _Unresolved(Exception):
    """A $ref in a shared place whose target this module cannot find: leave the schema open."""


def strict_schema(schema: Any) -> Any:
    """A copy of `schema` in which every self-contained object schema (the module docstring) gets
    `additionalProperties: false`, at every depth ($defs, items, anyOf, ...). Anything that is not a schema
    object comes back as it is."""
    return _pin(schema, False)


def loose_schema(schema: Any) -> Any:
    """The opposite pin: `additionalProperties: true` where `strict_schema` would write false, so the engine's
    strict default leaves the schema open (a tool that says `"strict": false`: JSON Schema's own rule)."""
    return _pin(schema, True)


def with_strictness(schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    """A schema as a request's `strict` asks: True closed, False open, None as the engine's
    `strict_json_schema` says. ValueError (not RecursionError) for one nested too deeply to rewrite."""
    if strict is None:
        return schema
    try:
        return strict_schema(schema) if strict else loose_schema(schema)
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None


def _pin(schema: Any, value: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    try:
        shared = _shared_targets(schema)
    except _Unresolved:
        return dict(schema)
    return _rewrite(_Node(schema, (), False), shared, value)


def _shared_targets(root: dict[str, Any]) -> set[Pointer]:
    """The places a $ref in a shared place (or with keywords beside it) points at, followed to a fixed point:
    a target found shared may itself be a $ref, or hold compositions, that share further places."""
    shared: set[Pointer] = set()
    while True:
        found = set(shared)
        for node in _walk(_Node(root, (), False), shared):
            ref = node.schema.get("$ref")
            if isinstance(ref, str) and (node.shared or set(node.schema) - _QUIET - {"$ref"}):
                found.add(_pointer(ref))
            if any(k in node.schema for k in ("$dynamicRef", "$recursiveRef")):
                raise _Unresolved  # resolved at run time, by the dynamic scope: cannot tell what it shares
        if found == shared:
            return shared
        shared = found


def _walk(node: _Node, shared: set[Pointer]) -> Iterator[_Node]:
    yield node
    for child in _children(node, shared):
        yield from _walk(child, shared)


def _children(node: _Node, shared: set[Pointer]) -> Iterator[_Node]:
    """Each subschema of `node` that is a dict, with its place and whether its instance is shared."""
    s, at = node.schema, node.at

    def child(sub: Any, place: Pointer, is_shared: bool) -> Iterator[_Node]:
        if isinstance(sub, dict):
            yield _Node(sub, place, is_shared or place in shared)

    for key in _OTHER_ONE + _SHARED_ONE:
        yield from child(s.get(key), at + (key,), key in _SHARED_ONE)
    for key in _OTHER_LISTS + _CHOICES + ("allOf",):
        members = s.get(key)
        if isinstance(members, list):
            # a choice held by a schema that says nothing else is the whole of its instance, as is a lone allOf
            alone = not (set(s) - _QUIET - {key}) and (key in _CHOICES or len(members) == 1)
            is_shared = key not in _OTHER_LISTS and (node.shared or not alone)
            for i, sub in enumerate(members):
                yield from child(sub, at + (key, str(i)), is_shared)
    for key in _OTHER_MAPS + _SHARED_MAPS + _DEFINITIONS:
        if isinstance(s.get(key), dict):
            for name, sub in s[key].items():
                yield from child(sub, at + (key, name), key in _SHARED_MAPS)


def _rewrite(node: _Node, shared: set[Pointer], value: bool) -> dict[str, Any]:
    out = dict(node.schema)
    if (isinstance(out.get("properties"), dict) and not node.shared and node.at not in shared
            and not any(k in out for k in ("additionalProperties", "unevaluatedProperties", *_REFS, *_COMPOSING))):
        out["additionalProperties"] = value
    for child in _children(node, shared):
        key, name = child.at[len(node.at)], child.at[-1]
        new = _rewrite(child, shared, value)
        if len(child.at) == len(node.at) + 1:
            out[key] = new
            continue
        if out[key] is node.schema[key]:  # a list or map of subschemas: copied once, then filled in
            out[key] = list(out[key]) if isinstance(out[key], list) else dict(out[key])
        out[key][int(name) if isinstance(out[key], list) else name] = new
    return out


def _pointer(ref: str) -> Pointer:
    """A local $ref ("#", "#/$defs/Base", percent- and ~-escaped) as a place; _Unresolved for any other."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        raise _Unresolved
    tokens = unquote(ref[1:]).split("/")[1:]
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in tokens)
