"""`AsyncLLMEngine`: one engine, many concurrent streaming callers (what the server runs on).

    caller coroutines                     event loop                 worker thread
    ─────────────────                     ──────────                 ─────────────
    async for out in generate(...)  ──>   commands queue  ───────>   apply adds / aborts
          ^                                                          engine.step()   (the model runs
          └──── per-request asyncio.Queue  <── call_soon_threadsafe ─┘                here, off-loop)

Only the worker thread touches the `LLMEngine`: adds and aborts are queued as commands and applied
between steps, so the engine stays single-threaded and the event loop never blocks on the model.
A request that arrives while others decode simply joins the next step's batch (continuous batching
across callers). Cancelling a consumer (a client disconnect) aborts its request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.engine.stats import EngineStats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    added: asyncio.Future
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.stats: EngineStats = engine.get_stats()  # refreshed by the worker after every step
        self.latency_observers: list[Any] = []  # callables(kind, seconds): "ttft" / "itl"
        self.error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._worker.start()

    # --- caller side (event loop) ----------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs as they change (cumulative text); the last one is finished.
        Raises the engine's ValueError/TypeError for a bad request before yielding anything."""
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), loop.create_future())
        self._send(("add", rid, prompt, sampling_params, stream))
        await stream.added  # validation happens in the worker; errors surface here
        finished = False
        try:
            while not finished:
                out = await stream.outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._send(("abort", rid, None, None, None))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id, None, None, None))

    def check_request(self, prompt: PromptType, sampling_params: SamplingParams | None) -> str | None:
        """Why a request can never run (prompt too long, pool too small), or None. Changes nothing."""
        seq = self.engine.make_sequence("check", prompt, sampling_params)
        return self.engine.unservable_reason(seq)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._worker.join(timeout=30)
        self.engine.shutdown()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # --- worker side (the only thread that touches the engine) ----------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._apply_commands():
                self.stats = self.engine.get_stats()  # aborts free blocks even without a step
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step changed nothing (see LLMEngine); fail its callers
                self.error = e
                for rid in list(self._streams):
                    self._deliver(rid, e)
                self.engine.abort_request(list(self.engine.requests), report=False)
                continue
            now = time.perf_counter()
            for out in outputs:
                self._record_latency(out, now)
                self._deliver(out.request_id, out)
            self.stats = self.engine.get_stats()

    def _apply_commands(self) -> bool:
        applied = False
        while True:
            try:
                kind, rid, prompt, sp, stream = self._commands.get_nowait()
            except queue.Empty:
                return applied
            applied = True
            if kind == "add":
                try:
                    self.engine.add_request(rid, prompt, sp)
                except Exception as e:
                    stream.loop.call_soon_threadsafe(_set_exception, stream.added, e)
                    continue
                self._streams[rid] = stream
                stream.loop.call_soon_threadsafe(_set_result, stream.added)
            else:
                self._streams.pop(rid, None)
                self.engine.abort_request(rid, report=False)

    def _record_latency(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None or not out.outputs[0].token_ids:
            return
        kind, since = ("ttft", stream.arrival) if stream.first_token is None else ("itl", stream.last_token)
        stream.first_token = stream.first_token or now
        stream.last_token = now
        for observe in self.latency_observers:
            observe(kind, now - since)

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[rid]
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
