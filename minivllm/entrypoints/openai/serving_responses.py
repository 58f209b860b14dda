"""POST /v1/responses: OpenAI's Responses API, on the same pipeline as chat (pipeline.py). Its front end reads the
request as a chat request (responses_protocol.py, after the stored conversation of `previous_response_id`:
response_store.py); its back end shapes the one post-processed choice as output items:

    {"type": "reasoning", "id": "rs_…", "summary": [], "content": [{"type": "reasoning_text", "text"}]}
                                                               the <think> part (--reasoning-parser)
    {"type": "message", "id": "msg_…", "role": "assistant", "content": [{"type": "output_text", "text",
     "annotations": [], "logprobs": []}]}                      the content, when there is any (or nothing else)
    {"type": "function_call", "id": "fc_…", "call_id": "call_…", "name", "arguments"}   one per tool call

    response = {"id": "resp_…", "object": "response", "status": "completed" | "incomplete", "output": [items],
                "incomplete_details": {"reason": "max_output_tokens"} | null, "usage": {"input_tokens",
                "input_tokens_details": {"cached_tokens"}, "output_tokens", "output_tokens_details":
                {"reasoning_tokens"}, "total_tokens"}, + the request's settings as used (temperature, tools, ...)}

Streamed, the events are OpenAI's (`event: <type>` and `data: {..., "sequence_number"}`, no `[DONE]`):

    response.created, response.in_progress
    per item: response.output_item.added
              reasoning: response.content_part.added, response.reasoning_text.delta…, response.reasoning_text.done,
                         response.content_part.done
              message:   response.content_part.added, response.output_text.delta…, response.output_text.done,
                         response.content_part.done
              call:      response.function_call_arguments.delta (the arguments whole), …arguments.done
              response.output_item.done
    response.completed (or response.incomplete), with the whole response; a failure: one `error` event

A choice's calls come whole when it ends (the tool-call parser never sends a piece of one), so a call's arguments
come in one delta. The response is stored (store: true, the default) once it is complete.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from minivllm.entrypoints.openai import streams
from minivllm.entrypoints.openai.errors import ApiError, api_error
from minivllm.entrypoints.openai.field_policy import RequestError, log_safe
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.postprocess import Processed
from minivllm.entrypoints.openai.preprocess import ServingContext
from minivllm.entrypoints.openai.protocol import now
from minivllm.entrypoints.openai.response_store import ResponseStore
from minivllm.entrypoints.openai.responses_protocol import ResponsesRequest, to_responses_param
from minivllm.entrypoints.openai.serving_chat import start_chat

log = logging.getLogger("minivllm.server")


async def create_response(ctx: ServingContext, req: ResponsesRequest, raw: Request, metrics: ServerMetrics,
                          store: ResponseStore) -> Any:
    rid, created = f"resp_{req.request_id or uuid.uuid4().hex}", now()
    try:
        req.check_unsupported()
        if req.request_id is not None and (rid in store or rid == req.previous_response_id):
            raise RequestError("request_id", f"a stored response already has the id {rid!r} (or it is this request's "
                                             "previous_response_id); send another request_id, or none")
        history = store.conversation(req.previous_response_id)
        chat = req.chat_request(history)
        run = await start_chat(ctx, chat, metrics, rid)
    except (ApiError, RequestError) as e:
        raise _renamed(api_error(e, "input")) from e
    conversation = history + req.conversation()  # what is stored: never the instructions

    def body(status: str, output: ResponseOutput) -> dict[str, Any]:
        usage = run.usage()
        reasoning = ctx.engine.engine.resolved.reasoning
        ids = run.latest[0].outputs[0].token_ids if run.latest else []
        thought = 0 if reasoning is None or not output.reasoned else \
            ids.index(reasoning.end_token_id) + 1 if reasoning.end_token_id in ids else len(ids)
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": rid, "object": "response", "created_at": created, "model": ctx.model_name, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata, "output": output.items,
                "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
                "reasoning": None, "store": req.store, "temperature": run.sp.temperature, "top_p": run.sp.top_p,
                "text": req.text or {"format": {"type": "text"}}, "tools": req.tools or [],
                "tool_choice": req.tool_choice or ("auto" if req.tools else "none"), "truncation": "disabled",
                "background": False, "usage": _usage(usage, thought)}

    def done(output: ResponseOutput) -> dict[str, Any]:
        answer = body("incomplete" if output.finish_reason == "length" else "completed", output)
        if req.store:
            store.put(rid, conversation + [output.assistant_turn()])
        return answer

    output = ResponseOutput(chat.include_reasoning)
    if not req.stream:
        processed = await run.whole(raw)
        if processed is None:
            return streams.client_left(rid)
        output.add(processed[0])
        output.finish()
        return done(output)

    async def events() -> AsyncIterator[dict[str, Any]]:
        started = body("in_progress", output)
        yield output.event("response.created", response=started)
        yield output.event("response.in_progress", response=started)
        async with aclosing(run.stream()) as steps:
            async for _, processed in steps:
                for p in processed:
                    for event in output.add(p):
                        yield event
        for event in output.finish():
            yield event
        answer = done(output)
        yield output.event(f"response.{answer['status']}", response=answer)

    return EventSourceResponse(_sse(rid, events(), output), ping=600)


async def _sse(rid: str, events: AsyncIterator[dict[str, Any]], output: ResponseOutput
               ) -> AsyncIterator[dict[str, str]]:
    """Each event as `event: <type>` + `data: <json>`; a failure after the 200 as one `error` event."""
    try:
        async with aclosing(events):
            async for event in events:
                yield {"event": event["type"], "data": json.dumps(event)}
    except Exception as e:
        error = api_error(e)
        log.warning("%s: the stream ended with an error: %s", log_safe(rid), error.message)
        event = output.event("error", code=error.code, message=error.message, param=error.param)
        yield {"event": "error", "data": json.dumps(event)}


def _usage(usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """Chat's usage in the Responses API's names."""
    cached = (usage["prompt_tokens_details"] or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": usage["total_tokens"]}


def _renamed(error: ApiError) -> ApiError:
    """A chat request's error, naming the Responses field the client sent."""
    if error.param is None:
        return error
    param = to_responses_param(error.param)
    message = param + error.message[len(error.param):] if error.message.startswith(error.param) else error.message
    if error.param == "max_tokens":  # the context-length message names the field in its text too
        message = message.replace("max_tokens", param)
    for chat, flat in _FLAT_TOOL_SHAPES:  # a hint in chat's nested tool shape, as this endpoint takes it
        message = message.replace(chat, flat)
    return ApiError(error.status, message, param, error.code)


_FLAT_TOOL_SHAPES = (('{"type": "function", "function": {"name": ..., "parameters": {...}}}',
                      '{"type": "function", "name": ..., "parameters": {...}}'),
                     ('{"type": "function", "function": {"name": ...}}', '{"type": "function", "name": ...}'))


class ResponseOutput:
    """One response's output items, built from its post-processed deltas (one whole delta, or many streamed);
    each step returns the stream events it makes, numbered in order."""

    def __init__(self, include_reasoning: bool) -> None:
        self.include_reasoning = include_reasoning
        self.items: list[dict[str, Any]] = []
        self.sequence_number = 0
        self.finish_reason: str | None = None
        self.reasoned = False  # the output had a reasoning part (its tokens count as reasoning_tokens)
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written
        self._text = ""  # the open item's text so far

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def add(self, p: Processed) -> list[dict[str, Any]]:
        events = []
        if p.reasoning is not None:
            self.reasoned = True
        if p.reasoning and self.include_reasoning:
            events += self._write("reasoning", p.reasoning)
        if p.content:
            events += self._write("message", p.content)
        if p.finish_reason:
            self.finish_reason = p.finish_reason
        if p.tool_calls:
            events += self._close()
            for call in p.tool_calls:
                events += self._call(call["function"]["name"], call["function"]["arguments"])
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Close the open item; an output with no item at all answers an empty message."""
        if not self.items:
            return self._write("message", "") + self._close()
        return self._close()

    def assistant_turn(self) -> dict[str, Any]:
        """The output as one chat message, for the conversation store."""
        turn: dict[str, Any] = {"role": "assistant", "content": None}
        for item in self.items:
            if item["type"] == "reasoning":
                turn["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                turn["content"] = (turn["content"] or "") + item["content"][0]["text"]
            else:
                turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return turn

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            prefix = "rs" if kind == "reasoning" else "msg"
            item = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind, "status": "in_progress", "content": []}
            item.update({"summary": []} if kind == "reasoning" else {"role": "assistant"})
            self._open, self._text = item, ""
            self.items.append(item)
            events += [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)),
                       self.event("response.content_part.added", **self._where(), part=self._part(""))]
        self._text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self.event(name, **self._where(), delta=text, **extra)]

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        part, kind = self._part(self._text), item["type"]
        item["content"] = [part]
        item["status"] = "incomplete" if self.finish_reason == "length" and kind == "message" else "completed"
        done = (self.event("response.reasoning_text.done", **self._where(), text=self._text) if kind == "reasoning"
                else self.event("response.output_text.done", **self._where(), text=self._text, logprobs=[]))
        events = [done, self.event("response.content_part.done", **self._where(), part=part),
                  self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)]
        self._open = None
        return events

    def _call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": f"call_{uuid.uuid4().hex[:24]}",
                "name": name, "arguments": "", "status": "in_progress"}
        self.items.append(item)
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events = [self.event("response.output_item.added", output_index=at["output_index"], item=dict(item)),
                  self.event("response.function_call_arguments.delta", **at, delta=arguments),
                  self.event("response.function_call_arguments.done", **at, name=name, arguments=arguments)]
        item.update(arguments=arguments, status="completed")
        return events + [self.event("response.output_item.done", output_index=at["output_index"], item=item)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _part(self, text: str) -> dict[str, Any]:
        if self._open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
