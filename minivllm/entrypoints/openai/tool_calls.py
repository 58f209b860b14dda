"""Tool calling on /v1/chat/completions: OpenAI's `tools` and `tool_choice`, vLLM's semantics.

    tool_choice   what the model may or must do                    how the answer is made
    "none"        answer in text (tools are still shown to it)     as without tools
    "auto"        text, or calls written as hermes blocks:         `parse_hermes` takes the calls out of the
                  <tool_call>{"name": ..., "arguments": {...}}</tool_call>   text (vLLM's --tool-call-parser hermes)
    "required"    at least one call of any tool                    decoding constrained to a JSON array
                                                                   [{"name": ..., "parameters": {...}}, ...]
    {"type": "function", "function": {"name": f}}                  decoding constrained to f's `parameters`:
                  exactly one call of f                            the output IS the arguments

With "required" and a named function the call is valid by construction (the arguments are valid against
the tool's `parameters` schema, strictly unless the tool says `"strict": false`); with "auto" a small model
may write anything (`strict` constrains nothing there, as in vLLM), and only well-formed blocks become calls.
A choice with calls has finish_reason "tool_calls" and `message.tool_calls`, each with an id
("chatcmpl-tool-<hex>"); its content is the text outside the blocks (None when empty).
A constrained output the grammar did not finish is no call: its text stays content, with its own finish_reason
("length": max_tokens; "stop": the client's stop / stop_token_ids, or an end inside <think>), never a 500.

How tools and earlier calls reach the prompt: tool_prompt.py.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from minivllm.entrypoints.openai.field_policy import RequestError
from minivllm.entrypoints.openai.structured import structured_outputs_params
from minivllm.entrypoints.openai.tool_prompt import CALL_CLOSE, CALL_OPEN, json_shape
from minivllm.schema_strictness import with_strictness
from minivllm.structured_outputs import StructuredOutputsParams, check_schema_size

_CUT = object()  # what _json gives for a text that holds no JSON value
_NO_PARAMETERS = {"type": "object", "properties": {}}  # a function without `parameters` takes no arguments
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what it asks of them, checked."""

    mode: ToolMode
    tools: list[dict[str, Any]]  # each {"type": "function", "function": {"name", "description"?, "parameters"?}}
    name: str | None = None  # NAMED: the function to call
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def parses_calls(self) -> bool:
        return self.mode is not ToolMode.NONE and bool(self.tools)

    def constraint(self) -> StructuredOutputsParams | None:
        """What "required" and a named function constrain decoding to (None: free text)."""
        if self.mode is ToolMode.NAMED:
            return StructuredOutputsParams(json=_parameters(self._function(self.name)))
        if self.mode is ToolMode.REQUIRED:  # each tool's arguments as strict as it says (_parameters)
            calls, defs = [], {}
            for i, t in enumerate(self.tools):
                calls.append({"type": "object", "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": _hoisted(_parameters(t["function"]), f"tool{i}", defs)},
                    "required": ["name", "parameters"], "additionalProperties": False})
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({"$defs": defs} if defs else {})}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished output that ended with "stop". Never raises: a constrained
        output the grammar did not finish (cut by the client's `stop` or `stop_token_ids`, or ended
        inside <think>, before the constraint began) is no call, and its text stays content (vLLM's)."""
        if self.mode is ToolMode.NAMED:  # any JSON value: the grammar checked it against `parameters`
            arguments = _json(text)
            return (text or None, []) if arguments is _CUT else (None, [tool_call(self.name, arguments)])
        if self.mode is ToolMode.REQUIRED:
            found, names = _json(text), {t["function"]["name"] for t in self.tools}
            if not isinstance(found, list) or not found or not all(
                    isinstance(c, dict) and c.get("name") in names and "parameters" in c for c in found):
                return text or None, []
            return None, [tool_call(c["name"], c["parameters"]) for c in found]
        content, calls = parse_hermes(text)
        return content, calls if self.parallel else calls[:1]

    def _function(self, name: str) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


class ToolCallingFields(BaseModel):
    """The chat request's tool-calling fields and what they make of its output (protocol.py's
    ChatCompletionRequest takes them from here)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # as the request's own
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True

    def tool_plan(self) -> ToolPlan:
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """A "required" or named tool_choice constrains the output (then nothing else may)."""
        return structured_outputs_params(self.response_format, self.structured_outputs, self.tool_plan().constraint())


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema as its `strict` asks (absent: EngineConfig.strict_json_schema decides)."""
    try:
        parameters = function.get("parameters") or _NO_PARAMETERS
        check_schema_size(parameters, "the schema")  # before the strict rewrite, which recurses once a level
        return with_strictness(parameters, function.get("strict"))
    except ValueError as e:
        raise RequestError("tools", f"{function['name']}'s parameters: {e}") from None


def _hoisted(parameters: dict[str, Any], key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as they go at items.anyOf[i].properties.parameters of the "required" schema, where its
    local `$ref`s would resolve against that schema's root: with a $ref, the parameters move to the root's
    `$defs[key]`, their `$defs` / `definitions` entries to `$defs[key_$defs_X]` (pydantic's `#/$defs/Loc`), and
    every `#...` ref is rewritten to match (`#` itself is the parameters). What stays in place is a $ref to them."""
    if '"$ref"' not in json.dumps(parameters):
        return parameters
    body = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    for section in ("$defs", "definitions"):
        for name, sub in (parameters.get(section) or {}).items():
            defs[f"{key}_{section}_{name}"] = _rewrite_refs(sub, key)
    defs[key] = _rewrite_refs(body, key)
    return {"$ref": f"#/$defs/{key}"}


def _rewrite_refs(schema: Any, key: str) -> Any:
    """`schema` with each local ref (`#`, `#/...`, its tokens kept as written) pointed into `$defs` (_hoisted)."""
    if isinstance(schema, list):
        return [_rewrite_refs(s, key) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rewrite_refs(v, key) for k, v in schema.items()}  # a $ref string comes back as it is
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        tokens = ref[2:].split("/") if ref != "#" else []
        if len(tokens) >= 2 and tokens[0] in ("$defs", "definitions"):
            out["$ref"] = "/".join([f"#/$defs/{key}_{tokens[0]}_{tokens[1]}", *tokens[2:]])
        else:
            out["$ref"] = "/".join([f"#/$defs/{key}", *tokens])
    return out


def _json(text: str) -> Any:
    """The JSON value `text` holds, or _CUT if it holds none (an output cut short)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return _CUT


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
              parallel: bool) -> ToolPlan:
    """Check `tools` and `tool_choice` (RequestError naming the field); OpenAI's default choice is "auto"
    with tools and "none" without."""
    tools = tools or []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise RequestError(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., '
                                              '"parameters": {...}}}')
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters", "must be a JSON Schema (an object)")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise RequestError(f"tools[{i}].function.strict", f"must be true or false, got {f['strict']!r}")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools", "two tools have the same name; give each function its own")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        name = _named_function(choice)
        if name not in names:
            raise RequestError("tool_choice", f"names no function of tools ({', '.join(names) or 'none given'}); "
                                              'use {"type": "function", "function": {"name": ...}}')
        return ToolPlan(ToolMode.NAMED, tools, name, parallel)
    if choice not in ("none", "auto", "required"):
        raise RequestError("tool_choice", f"{choice!r} is not one of none, auto, required or a named function")
    if choice == "required" and not tools:
        raise RequestError("tool_choice", '"required" needs tools')
    return ToolPlan(ToolMode(choice), tools, None, parallel)


def _named_function(choice: dict[str, Any]) -> str:
    """The name in a named tool_choice, {"type": "function", "function": {"name": ...}}; RequestError naming
    the part that has another shape (a string for "function" is a common mistake)."""
    if choice.get("type") != "function" or set(choice) != {"type", "function"}:
        raise RequestError("tool_choice", 'an object must be {"type": "function", "function": {"name": ...}}, '
                                          f"got {json_shape(choice)}")
    function = choice["function"]
    if not isinstance(function, dict) or set(function) != {"name"}:
        raise RequestError("tool_choice.function", f'must be {{"name": ...}}, got {json_shape(function)}')
    if not isinstance(function["name"], str):
        raise RequestError("tool_choice.function.name", f"must be a string, got {json_shape(function['name'])}")
    return function["name"]


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape: arguments as a JSON string, a fresh id."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The hermes parser: each <tool_call>{"name": ..., "arguments": {...}}</tool_call> block that holds a
    well-formed call becomes a call and leaves the content; anything else stays text."""
    calls, kept, at = [], [], 0
    for block in _BLOCK.finditer(text):
        try:
            call = json.loads(block.group(1))
        except (ValueError, RecursionError):  # not JSON, or nested past json's recursion ('[' * 3000): text
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[at:block.start()])
        at = block.end()
        calls.append(tool_call(call["name"], call.get("arguments", {})))
    kept.append(text[at:])
    content = "".join(kept).strip()
    return content or None, calls


class ToolCallStream:
    """One streamed choice of a request whose calls are parsed: the content that is safe to send now (never
    a piece of a call), then, when the choice ends, what is left of the content and the calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = plan, "", 0

    def content(self, delta: str) -> str:
        self.text += delta
        if self.plan.mode is not ToolMode.AUTO:  # the output is the calls' JSON: nothing is content
            return ""
        start = self.text.find(CALL_OPEN)
        # No block yet: hold back a tail that may be the start of "<tool_call>"; a block: stop at it.
        safe = start if start >= 0 else len(self.text) - _partial_open(self.text)
        out, self.sent = self.text[self.sent:max(safe, self.sent)], max(safe, self.sent)
        return out

    def finish(self, finish_reason: str) -> tuple[str, list[dict[str, Any]], str]:
        """(content still to send, calls, the choice's finish_reason) when the choice ends."""
        rest = self.text[self.sent:]
        if finish_reason != "stop":
            return rest, [], finish_reason
        content, calls = self.plan.calls(rest)
        return (content or "", calls, "tool_calls") if calls else (rest, [], finish_reason)


def _partial_open(text: str) -> int:
    """How long a tail of `text` is a proper prefix of "<tool_call>"."""
    return next((k for k in range(len(CALL_OPEN) - 1, 0, -1) if text.endswith(CALL_OPEN[:k])), 0)
