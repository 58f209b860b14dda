"""Consuming an HTTP request's engine outputs: to the end, interleaved, or as server-sent events.

The one rule: whatever ends the consumer (the client leaving, one of its requests failing, the
handler being cancelled), every generator it holds is closed, and closing a generator aborts its
request in the engine. Hence `aclosing` around every `async for` over a generator.

A request the engine failed on its own (finish_reason "error") raises `RequestFailed` here, so the
client gets an error (500, or an error event in a stream) and not a silently truncated answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import Request

from minivllm.entrypoints.openai.errors import RequestFailed, api_error
from minivllm.outputs import RequestOutput

log = logging.getLogger("minivllm.server")


def raise_if_failed(out: RequestOutput) -> None:
    if out.finished and out.outputs[0].finish_reason == "error":
        raise RequestFailed(out.error or "no reason was given")


async def sse(rid: str, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The stream's events, then `[DONE]`; a failure becomes one error event before it."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except Exception as e:
        error = api_error(e)
        log.warning("%s: the stream ended with an error: %s", rid, error.message)
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
