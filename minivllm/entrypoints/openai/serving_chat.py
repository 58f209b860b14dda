"""POST /v1/chat/completions: the messages through the model's chat template, one engine request
with n completions, one choice per completion. The two ends of the pipeline (pipeline.py): the messages
rendered into a prompt (preprocess.chat_prompt), and each post-processed choice shaped as a message or a delta.

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
from minivllm.entrypoints.openai.errors import ApiError, api_error
from minivllm.entrypoints.openai.logprobs import ChatLogprobs, TokenText, prompt_logprobs
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.pipeline import Run
from minivllm.entrypoints.openai.postprocess import Postprocessor, Processed, usage
from minivllm.entrypoints.openai.preprocess import ServingContext, TokensPrompt, chat_prompt
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, new_id, now
from minivllm.entrypoints.openai.reasoning import reasoning_fields
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


async def start_chat(ctx: ServingContext, req: ChatCompletionRequest, metrics: ServerMetrics, rid: str) -> Run:
    """The chat front end (also /v1/responses'): checks, then the pipeline's stages 1-2 over the chat prompt."""
    if getattr(ctx.tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    try:
        req.check_reasoning(ctx.engine.engine.resolved.reasoning)
    except ValueError as e:
        raise api_error(e, "include_reasoning") from e

    def postprocessor(prompts: list[TokensPrompt], sp: SamplingParams) -> Postprocessor:
        reasoning = ctx.engine.engine.resolved.reasoning  # the reasoning parser, if the server has one
        # Where the output starts (in reasoning or not), read from the prompt as the engine reads it.
        phase = reasoning.prompt_phase(prompts[0]["prompt_token_ids"]) if reasoning is not None else None
        return Postprocessor(stream=req.stream, phase=phase, plan=req.tool_plan(),
                             logprobs=ChatLogprobs(sp.logprobs or 0, TokenText(ctx.tokenizer,
                                                                               req.return_tokens_as_token_ids)))

    return await Run.start(ctx, req, lambda: [chat_prompt(ctx, req)], metrics, rid, postprocessor)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request,
                                 metrics: ServerMetrics) -> Any:
    rid, created = new_id("chatcmpl", req.request_id), now()
    run = await start_chat(ctx, req, metrics, rid)
    sp, echoed, reasons = run.sp, req.echoed(), run.post.phase is not None

    def whole_choice(p: Processed) -> dict[str, Any]:
        d = p.delta
        if p.tool_calls:  # the content outside the calls (echo is not repeated before calls)
            message = {"role": "assistant", "content": p.content, "tool_calls": p.tool_calls}
        else:
            message = {"role": "assistant", "content": echoed + (p.content or "")
                       if p.content is not None or echoed else None}
        if reasons:
            message.update(reasoning_fields(p.reasoning, req.include_reasoning))
        choice = {"index": d.index, "message": message, "logprobs": p.logprobs, "finish_reason": p.finish_reason,
                  "stop_reason": d.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = d.token_ids
        return choice

    if not req.stream:
        processed = await run.whole(raw)
        if processed is None:
            return streams.client_left(rid)
        out = run.latest[0]
        answer = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                  "choices": [whole_choice(p) for p in processed], "usage": run.usage(),
                  "prompt_logprobs": None if sp.prompt_logprobs is None else prompt_logprobs(out.prompt_logprobs)}
        if req.return_token_ids:
            answer["prompt_token_ids"] = out.prompt_token_ids
        return answer

    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options.continuous_usage_stats)
    num_prompt_tokens = len(run.prompts[0]["prompt_token_ids"])  # before the first output: for continuous usage

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
        async with aclosing(run.stream()) as steps:
            async for out, processed in steps:
                for p in processed:
                    d = p.delta
                    extra = {"stop_reason": d.stop_reason} if d.finish_reason else {}
                    if req.return_token_ids:
                        extra["token_ids"] = d.token_ids
                    shown = reasoning_fields(p.reasoning, req.include_reasoning) if p.reasoning else {}
                    # A choice's calls come whole, as its last delta, after the content held back.
                    yield chunk(d.index, _delta(shown, p.content), p.logprobs,
                                None if p.tool_calls else p.finish_reason, extra, out)
                    if p.tool_calls:
                        deltas = [{"index": k, **c} for k, c in enumerate(p.tool_calls)]
                        yield chunk(d.index, {"tool_calls": deltas}, None, p.finish_reason, extra, out)
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": run.usage()})

    return EventSourceResponse(streams.sse(rid, body()), ping=600)


def _delta(reasoning: dict[str, Any], text: str) -> dict[str, Any]:
    """A chunk's delta: the reasoning it carries, and its content unless it carries reasoning only."""
    return {**reasoning, "content": text} if text or not reasoning else reasoning
