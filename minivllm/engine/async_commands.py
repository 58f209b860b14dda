"""The async engine's hand-offs between caller coroutines and its worker thread (engine/async_engine.py):
each caller's mailbox (`CallerStream`), the typed commands the worker applies between steps, what a latency
observer is told, and the few calls that post to a caller's event loop from the worker thread.

Posting goes through `loop.call_soon_threadsafe`: asyncio objects are not thread-safe, so the worker never
touches a caller's queue or future itself; it asks the caller's loop to. A loop that is already closed (its
caller is gone) refuses, and the worker then aborts that request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from minivllm.engine.llm_engine import PromptType
from minivllm.sampling_params import SamplingParams


@dataclass
class CallerStream:
    """One caller's mailbox: the worker posts to it through its event loop."""
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    added: asyncio.Future  # resolved once the worker accepted (or refused) the request
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None


class AddRequest(NamedTuple):
    request_id: str
    prompt: PromptType
    sampling_params: SamplingParams | None
    stream: CallerStream
    priority: int = 0  # lower = sooner, with scheduling_policy="priority"


class AbortRequest(NamedTuple):
    request_id: str


Command = AddRequest | AbortRequest
# What a latency observer is told: time to first token, between outputs, or arrival to finish.
LatencyKind = Literal["ttft", "itl", "e2e"]


def notify(stream: CallerStream, callback: Callable[..., Any], *args: Any) -> bool:
    """Run `callback(*args)` on the caller's event loop; False if that loop is already closed."""
    try:
        stream.loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def refused(stream: CallerStream) -> bool:
    """The worker refused the add: there is no request to abort (and its id may belong to another)."""
    added = stream.added
    return added.done() and not added.cancelled() and added.exception() is not None


def set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
