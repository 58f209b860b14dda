"""POST /v1/responses' request, read as the chat request it is: its front end of the pipeline (pipeline.py).

OpenAI's Responses API asks what a chat completion asks, in other words. Every field below becomes a field of a
`ChatCompletionRequest`, so the prompt, the sampling, the tools and the grammars are the chat's own code:

    input: "text"                               messages [{"role": "user", "content": "text"}]
    input: [{"role", "content"}, ...]           messages; content parts input_text / output_text / text
    input: {"type": "function_call", ...}       an assistant message's tool_calls (one message for a run of calls)
    input: {"type": "function_call_output"}     {"role": "tool", "tool_call_id": call_id, "content": output}
    input: {"type": "reasoning", ...}           the next assistant message's reasoning_content (templates that
                                                keep earlier reasoning, Qwen3's, render it)
    instructions                                a system message first (never carried to the next response)
    previous_response_id                        that response's conversation, then this input (response_store.py)
    max_output_tokens                           max_tokens
    tools [{"type": "function", "name", ...}]   tools [{"type": "function", "function": {"name", ...}}]
    tool_choice {"type": "function", "name"}    tool_choice {"type": "function", "function": {"name"}}
    text.format json_schema / json_object       response_format (the same grammar code as chat)
    temperature, top_p, parallel_tool_calls, stream, and vLLM's extras (PASS_THROUGH)   as they are

A field of neither list is refused with a 400 naming it, except OpenAI's bookkeeping (NO_EFFECT: `user`,
`service_tier`, ...). Declared fields that ask for what this server does not do (background, include,
truncation "auto", reasoning effort, top_logprobs, max_tool_calls) are refused too. Errors the chat request
raises name the Responses field the client sent (`to_responses_param`: messages -> input, max_tokens ->
max_output_tokens, response_format.json_schema.schema -> text.format.schema, tools[i].function.x -> tools[i].x).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from minivllm.entrypoints.openai.field_policy import NO_EFFECT, RequestError, log_safe
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
from minivllm.entrypoints.openai.tool_prompt import json_shape

# vLLM's sampling extras, passed to the chat request as they are (it checks them, naming the field).
PASS_THROUGH = ("top_k", "min_p", "repetition_penalty", "seed", "stop", "stop_token_ids", "presence_penalty",
                "frequency_penalty", "logit_bias", "ignore_eos", "min_tokens", "skip_special_tokens",
                "include_stop_str_in_output", "bad_words", "allowed_token_ids", "structured_outputs",
                "chat_template_kwargs", "priority", "include_reasoning")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
# A chat request's field (a prefix of the error's param) -> the Responses field the client sent.
_RENAMED = (("max_completion_tokens", "max_output_tokens"),
            ("max_tokens", "max_output_tokens"), ("response_format.json_schema.", "text.format."),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("tool_choice.function.", "tool_choice."))


class ResponsesRequest(BaseModel):
    # strict, finite, extras kept to be passed through or refused by name: as the chat request's own model.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True  # kept in memory, for a later previous_response_id (false: forgotten at once)
    metadata: dict[str, str] | None = None  # returned as sent
    request_id: str | None = None  # vLLM's: the response's id is "resp_<request_id>"
    # OpenAI's, not implemented: anything but the default is refused (check_unsupported)
    background: bool = False
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    def check_unsupported(self) -> None:
        """The declared fields this server cannot honour, and every undeclared one but NO_EFFECT's."""
        refused = {"background": (self.background, "running a response in the background is not implemented"),
                   "include": (self.include, "none of the extra outputs include names is implemented"),
                   "truncation": (self.truncation not in (None, "disabled") and self.truncation,
                                  'only "disabled" (a prompt past the context is a 400) is implemented'),
                   "reasoning": (self.reasoning, "reasoning effort is not implemented; a template's switch (e.g. "
                                                 "Qwen3's enable_thinking) can be set through chat_template_kwargs"),
                   "top_logprobs": (self.top_logprobs, "logprobs are not implemented on /v1/responses; use "
                                                       "/v1/chat/completions"),
                   "max_tool_calls": (self.max_tool_calls is not None, "a cap on tool calls is not implemented; "
                                                                       "use parallel_tool_calls: false for one")}
        for name, (asked, why) in refused.items():
            if asked:
                raise RequestError(name, f"not supported by this server: {why}; leave it out")
        for name in self.model_extra or {}:
            if name not in PASS_THROUGH and name not in NO_EFFECT:
                raise RequestError(name[:40], f"/v1/responses has no field {log_safe(name, 40)}")

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one asks for, after the stored conversation `history` (RequestError naming
        the Responses field at fault)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        body: dict[str, Any] = {
            "model": self.model, "messages": messages + history + self.conversation(),
            "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "tools": [_chat_tool(t, i) for i, t in enumerate(self.tools or [])] or None,
            "tool_choice": _chat_tool_choice(self.tool_choice), "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _response_format(self.text), "stream": self.stream,
            **{k: v for k, v in (self.model_extra or {}).items() if k in PASS_THROUGH}}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = []
            for part in first["loc"]:  # a union's member tags ('str', 'list[int]') are not fields
                if isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict") or "[" in part):
                    break
                where.append(f"[{part}]" if isinstance(part, int) else f".{part}")
            raise RequestError(to_responses_param("".join(where).lstrip(".")), first["msg"]) from None

    def conversation(self) -> list[dict[str, Any]]:
        """`input` as chat messages (the table in the module docstring)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            where, kind = f"input[{i}]", item.get("type", "message")
            unknown = sorted(set(item) - _ITEM_FIELDS.get(kind, set(item)))  # (an unknown type: refused below)
            if unknown:
                raise RequestError(f"{where}.{unknown[0]}", f"not a field of a {kind} item; it has "
                                                            f"{', '.join(sorted(_ITEM_FIELDS[kind]))}")
            if kind == "message":
                out.append(_message(item, where, out))
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", where), "type": "function", "function": {
                    "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
                _assistant(out)["tool_calls"].append(call)
            elif kind == "function_call_output":
                output = item.get("output")
                text = output if isinstance(output, str) else _text(output, f"{where}.output")
                out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
            elif kind == "reasoning":
                key = "content" if item.get("content") else "summary"
                _assistant(out, fresh=True)["reasoning_content"] = _text(item.get(key) or [], f"{where}.{key}")
            else:
                raise RequestError(f"{where}.type", f"{kind!r} is not supported; use message, function_call, "
                                                    "function_call_output or reasoning")
        for m in out:  # an assistant turn with no calls has none (not an empty list) for the template
            m.pop("_open", None)
            if m["role"] == "assistant" and not m.get("tool_calls"):
                m.pop("tool_calls", None)
        return out


# The fields of each input item kind (`id` and `status`: what an output item sent back carries; no effect).
_ITEM_FIELDS = {"message": {"type", "role", "content", "id", "status"},
                "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
                "function_call_output": {"type", "call_id", "output", "id", "status"},
                "reasoning": {"type", "id", "summary", "content", "status"}}


def to_responses_param(param: str) -> str:
    """A chat request's field name as the Responses field it came from. A message's index is not the input's
    (instructions and the stored conversation come first): any message field is `input`."""
    if param.startswith("messages"):
        return "input"
    param = re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", param)
    for chat, responses in _RENAMED:
        if param.startswith(chat):
            return responses + param[len(chat):]
    return param


def _message(item: dict[str, Any], where: str, out: list[dict[str, Any]]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise RequestError(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {json_shape(role)}")
    content = item.get("content")
    text = content if isinstance(content, str) else _text(content, f"{where}.content")
    if role == "assistant" and out and out[-1].get("_open"):  # after its reasoning / calls: the same turn
        out[-1]["content"] = (out[-1]["content"] or "") + text
        return out.pop()
    return {"role": role, "content": text}


def _assistant(out: list[dict[str, Any]], fresh: bool = False) -> dict[str, Any]:
    """The assistant turn that output items (reasoning, calls) join: the last one, unless `fresh`."""
    if fresh or not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": None, "tool_calls": [], "_open": True})
    last = out[-1]
    last.setdefault("tool_calls", [])
    return last


def _text(parts: Any, where: str) -> str:
    """Text parts joined; any other part is refused (a text-only model cannot look at an image)."""
    if not isinstance(parts, list):
        raise RequestError(where, f"must be a string or a list of text parts, got {json_shape(parts)}")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in (*_TEXT_PARTS, "reasoning_text", "summary_text") \
                or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]", "only text parts ({\"type\": \"input_text\", \"text\": ...}) are "
                                                f"supported; this server takes text only, got {json_shape(part)}")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise RequestError(f"{where}.{key}", f"must be a string, got {json_shape(item.get(key))}")
    return item[key]


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested under "function")."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise RequestError(f"tools[{i}].type", f"{kind!r} tools are not supported; only function tools "
                                               '({"type": "function", "name": ..., "parameters": {...}})')
    function = {k: v for k, v in tool.items() if k != "type"}
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise RequestError(f"tools[{i}].{unknown[0]}", "not supported; a function tool has name, description, "
                                                       "parameters and strict")
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice  # none / auto / required: the chat request checks the value
    if choice.get("type") != "function" or set(choice) != {"type", "name"}:
        raise RequestError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}, '
                                          f"got {json_shape(choice)}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format (structured.py reads it)."""
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown or text.get("verbosity") is not None:
        raise RequestError(f"text.{(unknown or ['verbosity'])[0]}", "not supported; text takes format only")
    fmt = text.get("format")
    if fmt is None or not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt  # text / json_object / a wrong value: response_format's own checks name it
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
