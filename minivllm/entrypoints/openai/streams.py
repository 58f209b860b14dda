"""The pipeline's third stage: an HTTP request's engine outputs, consumed to the end, interleaved, as
per-choice deltas, and sent as server-sent events (pipeline.py has the whole path).

The one rule: whatever ends the consumer (the client leaving, one of its requests failing, the
handler being cancelled), every generator it holds is closed, and closing a generator aborts its
request in the engine. Hence `aclosing` around every `async for` over a generator.

A request the engine failed on its own (finish_reason "error") raises `RequestFailed` here, so the
client gets an error (500, or an error event in a stream) and not a silently truncated answer.

Outputs are cumulative (everything so far, per completion); `ChoiceTracker` turns them into what
each choice gained since its last chunk. A whole answer is the same thing taken once, at the end:

    prompt 1's RequestOutput(outputs=[c0, c1])  ──deltas(1, out)──>  [Delta(index=2), Delta(index=3)]
    (n = 2; a choice's index = prompt index * n + completion index, vLLM's order)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import NamedTuple

from starlette.requests import Request
from starlette.responses import Response

from minivllm.entrypoints.openai.errors import RequestFailed, api_error
from minivllm.entrypoints.openai.field_policy import log_safe
from minivllm.outputs import RequestOutput, SampleLogprobs

log = logging.getLogger("minivllm.server")

_FINISH = {"stop": "stop", "length": "length"}


def raise_if_failed(out: RequestOutput) -> None:
    """One failed completion fails the request: its answer would be incomplete."""
    if any(c.finish_reason == "error" for c in out.outputs):
        raise RequestFailed(out.error or "no reason was given")


class Delta(NamedTuple):
    """What one choice gained since its last chunk (everything, for a whole answer)."""
    index: int  # the choice's index in the answer
    output: RequestOutput  # the request it belongs to: prompt, prompt logprobs, token counts
    first: bool  # the choice's first delta: echo and prompt details go here
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None  # one dict per token in token_ids, when asked
    finish_reason: str | None  # "stop" | "length", in the choice's last delta only
    stop_reason: int | str | None  # the stop string or token id that ended it (vLLM's)


class ChoiceTracker:
    """Per choice, how much text and how many tokens were already sent. A delta is made when a
    choice has new text, or finishes; tokens whose text is still held back (part of a character,
    a possible stop string) ride with the next delta, so no token is sent twice or lost."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        self._finished: set[int] = set()

    def deltas(self, prompt_index: int, out: RequestOutput) -> list[Delta]:
        deltas = []
        for c in out.outputs:
            i = prompt_index * self.n + c.index
            first = i not in self._sent
            chars, tokens = self._sent.get(i, (0, 0))
            if i in self._finished or (len(c.text) == chars and not c.finished):
                continue
            self._sent[i] = (len(c.text), len(c.token_ids))
            if c.finished:
                self._finished.add(i)
            deltas.append(Delta(i, out, first, c.text[chars:], c.token_ids[tokens:],
                                None if c.logprobs is None else c.logprobs[tokens:],
                                _FINISH.get(c.finish_reason, "stop") if c.finished else None,  # abort: nobody reads it
                                c.stop_reason))
        return deltas


def client_left(rid: str) -> Response:
    log.info("%s: the client disconnected; its request was aborted", log_safe(rid))  # the client's request_id
    return Response(status_code=499)  # nginx's "client closed request": nobody will read it


async def sse(rid: str, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The stream's events, then `[DONE]`; a failure becomes one error event before it."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except Exception as e:
        error = api_error(e)
        log.warning("%s: the stream ended with an error: %s", log_safe(rid), error.message)
        yield error.event()
    yield "[DONE]"


async def finals(gens: list[AsyncIterator[RequestOutput]], raw: Request) -> list[RequestOutput] | None:
    """Run the generators to completion; None if the client left first (polled every 0.5 s: a
    non-streaming handler is not cancelled by a disconnect). Raises `ApiError` if one failed."""
    tasks = [asyncio.ensure_future(_last(g)) for g in gens]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t.exception() for t in done if t.exception() is not None]
            if failed:
                raise api_error(failed[0])
            if not pending:
                return [t.result() for t in tasks]
            if await raw.is_disconnected():
                return None
    finally:
        for t in tasks:
            t.cancel()  # a no-op for the finished ones; aborts the others
        await asyncio.gather(*tasks, return_exceptions=True)


async def _last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async with aclosing(gen):
        async for out in gen:
            raise_if_failed(out)
    return out


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as (index, output) as they arrive; closing this closes
    (aborts) them all."""
    if len(gens) == 1:
        async with aclosing(gens[0]) as gen:
            async for out in gen:
                raise_if_failed(out)
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as e:  # hand the failure to the consumer rather than dying silently
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        done = 0
        while done < len(gens):
            i, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            raise_if_failed(out)
            done += out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()  # cancelling a pump cancels its generator, which aborts its request
