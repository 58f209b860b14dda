"""POST /v1/completions: each prompt runs as one engine request with n completions; the answer has
one choice per (prompt, completion), `index = prompt index * n + completion index` (vLLM's order). The two ends
of the pipeline (pipeline.py): the prompts tokenized (preprocess.completion_prompts), and each post-processed
choice shaped as a choice or a chunk's choice; echo is this endpoint's own step of post-processing.

    choice = {"index", "text", "logprobs", "finish_reason", "stop_reason"}
             + "prompt_logprobs" (vLLM's)            + "prompt_token_ids", "token_ids" (return_token_ids)

- echo: the prompt's text comes first in the choice's text; with logprobs, the prompt's tokens
  and their logprobs come first too (the first prompt token's logprob is null). echo with
  max_tokens=0 answers the prompt alone: how lm-eval scores a text. The engine computes one token
  to run the prompt; the answer drops it, and its usage counts 0 completion tokens.
- Streaming: a chunk per choice that gained text, the choice's last one with its finish_reason;
  usage on every chunk with stream_options.continuous_usage_stats, in a last chunk without
  choices with stream_options.include_usage.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from minivllm.entrypoints.openai import streams
from minivllm.entrypoints.openai.logprobs import CompletionLogprobs, TokenText, prompt_logprobs
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.pipeline import Run
from minivllm.entrypoints.openai.postprocess import Postprocessor, Processed, usage
from minivllm.entrypoints.openai.preprocess import ServingContext, completion_prompts
from minivllm.entrypoints.openai.protocol import CompletionRequest, new_id, now
from minivllm.entrypoints.openai.streams import Delta


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request, metrics: ServerMetrics) -> Any:
    rid = new_id("cmpl", req.request_id)
    head = {"id": rid, "object": "text_completion", "created": now(), "model": ctx.model_name}
    text = TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
    run = await Run.start(ctx, req, lambda: completion_prompts(ctx, req), metrics, rid,
                          lambda prompts, sp: Postprocessor(stream=req.stream, logprobs=CompletionLogprobs(text),
                                                            echo=CompletionEcho(req, ctx.tokenizer)))
    generated = not req.echo_only  # echo with max_tokens=0 shows nothing generated
    if not req.stream:
        processed = await run.whole(raw)
        if processed is None:
            return streams.client_left(rid)
        return {**head, "choices": [_choice(req, p, whole=True) for p in processed],
                "usage": run.usage(generated=generated)}

    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options.continuous_usage_stats)

    async def body() -> AsyncIterator[str]:
        async with aclosing(run.stream()) as steps:
            async for out, processed in steps:
                for p in processed:
                    chunk = {**head, "choices": [_choice(req, p)]}
                    if continuous:
                        chunk["usage"] = usage([out], generated=generated, details=False)
                    yield json.dumps(chunk)
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": run.usage(generated=generated)})

    return EventSourceResponse(streams.sse(rid, body()), ping=600)


def _choice(req: CompletionRequest, p: Processed, whole: bool = False) -> dict[str, Any]:
    """The choice's chunk (a stream), or the whole choice (`whole`: with prompt_logprobs)."""
    d = p.delta
    choice = {"index": d.index, "text": p.content, "logprobs": p.logprobs, "finish_reason": d.finish_reason,
              "stop_reason": d.stop_reason}
    if req.return_token_ids:
        choice["token_ids"] = [] if req.echo_only else d.token_ids
        if d.first:
            choice["prompt_token_ids"] = d.output.prompt_token_ids
    if whole:
        choice["prompt_logprobs"] = None if req.prompt_logprobs is None else prompt_logprobs(d.output.prompt_logprobs)
    return choice


class CompletionEcho:
    """echo as post-processing's first step: a choice's first delta starts with the prompt (its text, ids
    and logprobs); with max_tokens=0 (`echo_only`), the one token generated to run the prompt is dropped."""

    def __init__(self, req: CompletionRequest, tokenizer: Any) -> None:
        self.req, self.tokenizer = req, tokenizer

    def __call__(self, d: Delta) -> Delta:
        req, out = self.req, d.output
        text, token_ids, logprobs = d.text, d.token_ids, d.logprobs
        if req.echo_only:  # the one token generated was only there to run the prompt
            text, token_ids, logprobs = "", [], None if logprobs is None else []
        if req.echo and d.first:
            text = self._prompt_text(out.prompt, out.prompt_token_ids) + text
            token_ids = out.prompt_token_ids + token_ids
            logprobs = None if logprobs is None else list(out.prompt_logprobs) + logprobs
        return d._replace(text=text, token_ids=token_ids, logprobs=logprobs)

    def _prompt_text(self, prompt: str | None, prompt_token_ids: list[int]) -> str:
        if prompt is not None and self.req.truncate_prompt_tokens is None:
            return prompt
        return self.tokenizer.decode(prompt_token_ids)  # token ids, or a prompt cut to its last tokens
