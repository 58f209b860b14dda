"""POST /v1/chat/completions: the messages through the model's chat template, one engine request
with n completions, one choice per completion.

    choice = {"index", "message": {"role": "assistant", "content", "tool_calls"?}, "logprobs", "finish_reason",
              "stop_reason"}
    answer = {..., "choices", "usage", "prompt_logprobs" (vLLM's)}

- logprobs: true (+ top_logprobs: N) gives each token's logprob and its N most likely alternatives.
- add_generation_prompt / continue_final_message (vLLM's): open a new assistant turn (the default),
  or leave the final assistant message open and continue it ("prefill" the answer's start).
- echo (vLLM's): the answer repeats the last message first, when that message is the assistant's.
- tools / tool_choice: calls parsed out of the output, or decoding constrained to them (tool_calls.py);
  a choice with calls has finish_reason "tool_calls". Streamed, its content is sent as it comes (never a
  piece of a call), and its calls whole, in one delta, when it ends.
- --reasoning-parser: the <think>...</think> part as `reasoning_content` (and `reasoning`), the rest as
  content (reasoning.py); tool calls are parsed from the content only. Streamed, the reasoning deltas
  come first, then the content's.
- Streaming: a first chunk per choice with the role, then a chunk per choice that gained text, the
  choice's last one with its finish_reason; usage as for completions (the running usage of
  continuous_usage_stats has the three counts; prompt_tokens_details comes with the last usage).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from minivllm.entrypoints.openai import streams
from minivllm.entrypoints.openai.beam_search import beam_search
from minivllm.entrypoints.openai.errors import ApiError, api_error
from minivllm.entrypoints.openai.logprobs import TokenText, chat_logprobs, prompt_logprobs
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.preprocess import ServingContext, chat_prompt
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, new_id, now
from minivllm.entrypoints.openai.reasoning import reasoning_fields
from minivllm.entrypoints.openai.streams import ChoiceTracker, Delta, usage
from minivllm.entrypoints.openai.tool_calls import ToolCallStream
from minivllm.outputs import RequestOutput
from minivllm.reasoning import ReasoningStream, split_reasoning


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request,
                                 metrics: ServerMetrics) -> Any:
    if getattr(ctx.tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    reasoning = ctx.engine.engine.resolved.reasoning  # the reasoning parser, if the server has one
    try:
        req.check_reasoning(reasoning)
    except ValueError as e:
        raise api_error(e, "include_reasoning") from e
    [prompt], sp = await ctx.admit(req, lambda: [chat_prompt(ctx, req)])
    # Where the output starts (in reasoning or not), read from the prompt as the engine reads it.
    phase = reasoning.prompt_phase(prompt["prompt_token_ids"]) if reasoning is not None else None
    rid, created = new_id("chatcmpl", req.request_id), now()
    beams = req.beam_search_params(ctx.limits)  # use_beam_search: n beams (entrypoints/openai/beam_search.py)
    gen = metrics.track(beam_search(ctx.engine, prompt, beams, new_id(rid), req.priority) if beams is not None else
                        ctx.engine.generate(prompt, sp, new_id(rid), req.priority), sp)  # id unique even if reused
    text = TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
    tracker, echoed = ChoiceTracker(sp.n), req.echoed()

    def logprobs(d: Delta) -> dict[str, list] | None:
        return None if d.logprobs is None else chat_logprobs(d.token_ids, d.logprobs, sp.logprobs, text)

    plan = req.tool_plan()

    def whole_choice(d: Delta) -> dict[str, Any]:
        thought, text = None, d.text
        if phase is not None:
            split = split_reasoning(d.text, phase)
            thought, text = split.reasoning, split.content
        message = {"role": "assistant", "content": echoed + text if text is not None or echoed else None}
        finish = d.finish_reason
        if plan.parses_calls and finish == "stop":  # tool calls (tool_calls.py), in the content alone
            content, calls = plan.calls(text or "")
            if calls:
                message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        if phase is not None:
            message.update(reasoning_fields(thought, req.include_reasoning))
        choice = {"index": d.index, "message": message, "logprobs": logprobs(d), "finish_reason": finish,
                  "stop_reason": d.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = d.token_ids
        return choice

    if not req.stream:
        finals = await streams.finals([gen], raw)
        if finals is None:
            return streams.client_left(rid)
        out = finals[0]
        answer = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                  "choices": [whole_choice(d) for d in tracker.deltas(0, out)], "usage": usage(finals),
                  "prompt_logprobs": None if sp.prompt_logprobs is None else prompt_logprobs(out.prompt_logprobs)}
        if req.return_token_ids:
            answer["prompt_token_ids"] = out.prompt_token_ids
        return answer

    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options.continuous_usage_stats)
    num_prompt_tokens = len(prompt["prompt_token_ids"])  # before the first output: for continuous usage

    def chunk(index: int, delta: dict[str, str], logprobs: Any = None, finish: str | None = None,
              extra: dict[str, Any] | None = None, out: RequestOutput | None = None) -> str:
        body = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish, **(extra or {})}]}
        if continuous:  # before the first output (role, echo): nothing generated yet
            body["usage"] = usage([out], details=False) if out is not None else {
                "prompt_tokens": num_prompt_tokens, "completion_tokens": 0, "total_tokens": num_prompt_tokens}
        return json.dumps(body)

    async def body() -> AsyncIterator[str]:
        for i in range(sp.n):
            yield chunk(i, {"role": "assistant", "content": ""})
            if echoed:
                yield chunk(i, {"content": echoed})
        final = None
        calls = [ToolCallStream(plan) for _ in range(sp.n)] if plan.parses_calls else None
        thoughts = [ReasoningStream(phase) for _ in range(sp.n)] if phase is not None else None
        async with aclosing(streams.merge([gen])) as outputs:
            async for _, out in outputs:
                final = out
                for d in tracker.deltas(0, out):
                    extra = {"stop_reason": d.stop_reason} if d.finish_reason else {}
                    if req.return_token_ids:
                        extra["token_ids"] = d.token_ids
                    thought, text = _split(thoughts[d.index], d) if thoughts is not None else ("", d.text)
                    shown = reasoning_fields(thought, req.include_reasoning) if thought else {}
                    if calls is None:
                        yield chunk(d.index, _delta(shown, text), logprobs(d), d.finish_reason, extra, out)
                        continue
                    text, made, finish = calls[d.index].content(text), [], d.finish_reason
                    if finish:  # the content held back, then the calls, each whole, as the last delta
                        rest, made, finish = calls[d.index].finish(finish)
                        text += rest
                    yield chunk(d.index, _delta(shown, text), logprobs(d), None if made else finish, extra, out)
                    if made:
                        deltas = [{"index": k, **c} for k, c in enumerate(made)]
                        yield chunk(d.index, {"tool_calls": deltas}, None, finish, extra, out)
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": usage([final])})

    return EventSourceResponse(streams.sse(rid, body()), ping=600)


def _split(stream: ReasoningStream, d: Delta) -> tuple[str, str]:
    """A choice's new text as (reasoning, content) that can be sent now; all of it when the choice ends."""
    thought, text = stream.feed(d.text)
    if d.finish_reason:
        more = stream.finish()
        thought, text = thought + more[0], text + more[1]
    return thought, text


def _delta(reasoning: dict[str, Any], text: str) -> dict[str, Any]:
    """A chunk's delta: the reasoning it carries, and its content unless it carries reasoning only."""
    return {**reasoning, "content": text} if text or not reasoning else reasoning
