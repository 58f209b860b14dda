"""POST /v1/completions: each prompt runs as one engine request with n completions; the answer has
one choice per (prompt, completion), `index = prompt index * n + completion index` (vLLM's order).

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
from minivllm.entrypoints.openai.beam_search import beam_search
from minivllm.entrypoints.openai.logprobs import TokenText, completion_logprobs, prompt_logprobs
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.preprocess import ServingContext, completion_prompts
from minivllm.entrypoints.openai.protocol import CompletionRequest, new_id, now
from minivllm.entrypoints.openai.streams import ChoiceTracker, Delta, usage


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request, metrics: ServerMetrics) -> Any:
    prompts, sp = await ctx.admit(req, lambda: completion_prompts(ctx, req))
    rid = new_id("cmpl", req.request_id)
    head = {"id": rid, "object": "text_completion", "created": now(), "model": ctx.model_name}
    # Engine ids stay unique even when clients reuse a request_id.
    beams = req.beam_search_params(ctx.limits)  # use_beam_search: n beams (entrypoints/openai/beam_search.py)
    gens = [metrics.track(beam_search(ctx.engine, p, beams, new_id(f"{rid}-{i}"), req.priority) if beams is not None else
                          ctx.engine.generate(p, sp, new_id(f"{rid}-{i}"), req.priority), sp)
            for i, p in enumerate(prompts)]
    choices, tracker = CompletionChoices(req, ctx.tokenizer), ChoiceTracker(sp.n)
    generated = not req.echo_only  # echo with max_tokens=0 shows nothing generated
    if not req.stream:
        finals = await streams.finals(gens, raw)
        if finals is None:
            return streams.client_left(rid)
        deltas = [d for i, out in enumerate(finals) for d in tracker.deltas(i, out)]
        return {**head, "choices": [choices.choice(d, whole=True) for d in deltas],
                "usage": usage(finals, generated=generated)}

    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options.continuous_usage_stats)

    async def body() -> AsyncIterator[str]:
        latest = {}  # prompt index -> its latest output, for usage
        async with aclosing(streams.merge(gens)) as outputs:
            async for i, out in outputs:
                latest[i] = out
                for d in tracker.deltas(i, out):
                    chunk = {**head, "choices": [choices.choice(d)]}
                    if continuous:
                        chunk["usage"] = usage([out], generated=generated, details=False)
                    yield json.dumps(chunk)
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": usage(list(latest.values()), generated=generated)})

    return EventSourceResponse(streams.sse(rid, body()), ping=600)


class CompletionChoices:
    """Builds a request's choices from deltas; keeps each choice's text offset for logprobs."""

    def __init__(self, req: CompletionRequest, tokenizer: Any) -> None:
        self.req, self.tokenizer = req, tokenizer
        self.token_text = TokenText(tokenizer, req.return_tokens_as_token_ids)
        self._offsets: dict[int, int] = {}  # choice index -> characters of token text sent

    def choice(self, d: Delta, whole: bool = False) -> dict[str, Any]:
        """The choice's chunk (a stream), or the whole choice (`whole`: with prompt_logprobs)."""
        req, out = self.req, d.output
        text, token_ids, logprobs = d.text, d.token_ids, d.logprobs
        if req.echo_only:  # the one token generated was only there to run the prompt
            text, token_ids, logprobs = "", [], None if logprobs is None else []
        if req.echo and d.first:
            text = self._prompt_text(out.prompt, out.prompt_token_ids) + text
            token_ids = out.prompt_token_ids + token_ids
            logprobs = None if logprobs is None else list(out.prompt_logprobs) + logprobs
        choice = {"index": d.index, "text": text, "logprobs": None, "finish_reason": d.finish_reason,
                  "stop_reason": d.stop_reason}
        if logprobs is not None:
            choice["logprobs"], self._offsets[d.index] = completion_logprobs(
                token_ids, logprobs, self.token_text, self._offsets.get(d.index, 0))
        if req.return_token_ids:
            choice["token_ids"] = [] if req.echo_only else d.token_ids
            if d.first:
                choice["prompt_token_ids"] = out.prompt_token_ids
        if whole:
            choice["prompt_logprobs"] = None if req.prompt_logprobs is None else prompt_logprobs(out.prompt_logprobs)
        return choice

    def _prompt_text(self, prompt: str | None, prompt_token_ids: list[int]) -> str:
        if prompt is not None and self.req.truncate_prompt_tokens is None:
            return prompt
        return self.tokenizer.decode(prompt_token_ids)  # token ids, or a prompt cut to its last tokens
