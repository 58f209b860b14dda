"""`use_beam_search` on the server: vLLM's beam search (minivllm/beam_search.py) over the
`AsyncLLMEngine`, answered as one request with n completions, the best beam first.

    for each step:   the live beams' one-token requests, concurrently  ──>  engine.generate(...) each
                     (other clients' requests share the same engine steps: continuous batching)
                     their finished outputs  ──>  BeamSearch.advance  ──>  the next beams
    then:            one finished RequestOutput, completion i = the i-th best beam (generated part only)

What the rest of the server sees is what `engine.generate` gives with FINAL_ONLY: an async iterator
yielding one finished output, so the answer, the stream, usage and metrics need nothing of their own.
Closing or cancelling it (the client left) cancels the step's requests, and closing each of those
aborts it in the engine: no beam outlives its caller, and a search holds no blocks between steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from minivllm.beam_search import BeamSearch, BeamSearchFailed, BeamSearchParams, step_sampling_params
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.openai.errors import RequestFailed
from minivllm.outputs import CompletionOutput, RequestOutput


async def beam_search(engine: AsyncLLMEngine, prompt: dict[str, Any], params: BeamSearchParams, request_id: str,
                      priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Yield the finished answer of a beam search over `prompt` ({"prompt", "prompt_token_ids"}, checked
    already). Raises `RequestFailed` if one of its beam requests failed on its own."""
    ids = list(prompt["prompt_token_ids"])
    search = BeamSearch(ids, params, engine.engine.eos_token_ids, prompt.get("prompt"))
    sp = step_sampling_params(params)
    num_cached = 0
    while not search.done:
        step = search.num_steps
        try:
            async with asyncio.TaskGroup() as group:  # one fails or is cancelled: the others are cancelled too
                tasks = [group.create_task(_final(engine.generate(p, sp, f"{request_id}-s{step}-b{i}", priority)))
                         for i, p in enumerate(search.step_prompts())]
        except BaseExceptionGroup as failed:  # the first failure, as a lone request would raise it
            raise failed.exceptions[0] from None
        outputs = [t.result() for t in tasks]
        if step == 0:
            num_cached = outputs[0].num_cached_tokens  # the prompt's prefix-cache hits
        try:
            search.advance(outputs)
        except BeamSearchFailed as e:
            raise RequestFailed(str(e)) from e
    tokenizer = engine.engine.tokenizer
    best = search.output(tokenizer).sequences
    completions = []
    for i, beam in enumerate(best):
        generated = beam.tokens[len(ids):]
        completions.append(CompletionOutput(i, tokenizer.decode(generated, skip_special_tokens=True), generated,
                                            beam.finish_reason, beam.stop_reason, beam.cum_logprob))
    yield RequestOutput(request_id, prompt.get("prompt"), ids, completions, True, num_cached)


async def _final(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A request's finished output; closing `gen` on the way out (cancelled included) aborts it."""
    out = None
    async with aclosing(gen):
        async for out in gen:
            pass
    assert out is not None and out.finished
    return out
