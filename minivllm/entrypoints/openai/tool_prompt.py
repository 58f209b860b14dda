"""How tools and an earlier answer's calls reach the prompt of /v1/chat/completions (tool_calls.py makes
the answer's calls; this module writes the conversation the template sees).

The prompt: tools go to the chat template (`tools=`). A template that ignores them (the default model's)
gets them as a system message instead, in this format (`tools_system_prompt`), which also tells the
model how to write a call:

    # Tools
    The functions below can be called. Each is described by a JSON object on its own line:
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
    To call one, write a JSON object with its name and arguments between <tool_call> and </tool_call>:
    <tool_call>
    {"name": "<function name>", "arguments": {<arguments as a JSON object>}}
    </tool_call>

prepended to the first system message, or as one of its own. Assistant turns' `tool_calls` (checked first,
whatever the template: OpenAI's shape, a 400 naming the field) are then written into their content as such
blocks, and `role: "tool"` turns render as the template renders any role. `content: null` renders as "".
"""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.openai.field_policy import RequestError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def json_shape(value: Any) -> str:
    """What a client sent, for an error message: its JSON type (an object also lists its keys)."""
    if isinstance(value, dict):
        return f"an object with {sorted(value)}"
    names = {str: "a string", list: "an array", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), "null")


def check_history_calls(calls: Any, where: str) -> None:
    """A message's `tool_calls` (an earlier answer's calls, sent back): OpenAI's shape, checked before the
    template sees them; RequestError naming the field (`where` is the message, "messages[1]")."""
    if calls is not None and not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls", f"must be an array of calls, got {json_shape(calls)}")
    for j, call in enumerate(calls or []):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise RequestError(at, 'must be {"id": ..., "type": "function", "function": {"name": ..., '
                                   f'"arguments": "<JSON>"}}}}, got {json_shape(call)}')
        if call.get("type", "function") != "function":
            raise RequestError(f"{at}.type", 'must be "function"')
        if not isinstance(call.get("id", ""), str):
            raise RequestError(f"{at}.id", f"must be a string, got {json_shape(call['id'])}")
        function = call["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{at}.function.name", f"must be a non-empty string, got {json_shape(function.get('name'))}")
        if not isinstance(function.get("arguments"), str):
            raise RequestError(f"{at}.function.arguments", "must be a string (the arguments as JSON, as answers "
                                                           f"give them), got {json_shape(function.get('arguments'))}")


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools as a system message (the format in the module docstring)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\nThe functions below can be called. Each is described by a JSON object on its own line:\n"
            f"{lines}\nTo call one, write a JSON object with its name and arguments between {CALL_OPEN} and "
            f"{CALL_CLOSE}:\n{CALL_OPEN}\n"
            '{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n'
            f"{CALL_CLOSE}")


def with_tools_in_system(conversation: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that ignores `tools=`: the tools as (the start of) the system message, and assistant
    turns' tool_calls written as hermes blocks in their content."""
    prompt = tools_system_prompt(tools)
    out = [dict(m) for m in conversation]
    for m in out:
        calls = m.pop("tool_calls", None) if m["role"] == "assistant" else None
        if calls:
            blocks = [f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": _arguments(c["function"]["arguments"])},
                                                    ensure_ascii=False) + f"\n{CALL_CLOSE}" for c in calls]
            m["content"] = "\n".join(filter(None, [m["content"], *blocks]))
    if out and out[0]["role"] == "system":
        out[0]["content"] = prompt + "\n\n" + out[0]["content"]
        return out
    return [{"role": "system", "content": prompt}, *out]


def _arguments(arguments: str) -> Any:
    """OpenAI sends a call's arguments as a JSON string (check_history_calls); the block holds the object
    (or the string as it came, where it holds no JSON value)."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
