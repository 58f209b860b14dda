"""`AsyncLLMEngine`: one engine, many concurrent streaming callers (what the server runs on).

    caller coroutines                     event loop                 worker thread
    ─────────────────                     ──────────                 ─────────────
    async for out in generate(...)  ──>   commands queue  ───────>   apply AddRequest / AbortRequest
          ^                                                          engine.step()   (the model runs
          └──── per-request asyncio.Queue  <── call_soon_threadsafe ─┘                here, off-loop)

Only the worker thread touches the `LLMEngine`: adds and aborts are queued as typed commands and
applied between steps, so the engine stays single-threaded and the event loop never blocks on the
model. A request that arrives while others decode simply joins the next step's batch (continuous
batching across callers).

Invariants, and how each failure reaches the caller:
- No request outlives its caller. Cancelling or closing `generate` at any point, even while its add
  is still queued behind a long step, sends an abort; a caller whose event loop is gone is aborted too.
- Refused at the door: a request that can never run (bad input, longer than max_model_len, more KV
  blocks than the pool) raises ValueError/TypeError in its caller before any output.
- Isolated: a request the engine fails on its own finishes with finish_reason "error" and
  `RequestOutput.error`; everybody else carries on.
- A failed step (`StepFailedError`, or any ordinary exception from `step()`) was rolled back; the
  requests in flight are aborted and their callers get `StepFailedError`; the worker keeps serving.
  A proposer that fails after a step's commit fails only the requests still running: the outputs the
  engine holds (`LLMEngine.take_pending`, e.g. of a request that finished in that step) go out first.
- Fatal: `EngineDeadError` from `step()`, or any exception escaping the worker loop, marks the engine
  dead. Every caller, in flight or new, gets `EngineDeadError`; `is_healthy` turns False.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from minivllm.engine.async_commands import (AbortRequest, AddRequest, CallerStream, Command, LatencyKind, notify,
                                            refused, set_exception, set_result)
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.engine.metrics.stats import EngineStats
from minivllm.engine.processing.input_processor import Unservable
from minivllm.engine.request.errors import EngineDeadError, StepFailedError
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams




class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, CallerStream] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Orders "queue a command" against "die and fail what is queued": no add slips in between.
        self._lock = threading.Lock()
        self.stats: EngineStats = engine.get_stats()  # refreshed by the worker after every step
        self.latency_observers: list[Callable[[LatencyKind, float], Any]] = []  # (kind, seconds)
        self.step_observers: list[Callable[[int], Any]] = []  # each step's tokens: prompts + generated, at commit
        self.last_step_error: BaseException | None = None  # the latest failed step's exception
        self.dead_error: EngineDeadError | None = None  # set once, when the engine can no longer serve
        self._worker = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._worker.start()

    # --- caller side (event loop) ----------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs as they change (cumulative text, or what the params'
        `output_kind` asks: DELTA yields what is new, FINAL_ONLY only the finished output, which then
        also counts as the first token for the latency metrics); the last one is finished.

        Raises ValueError/TypeError for a request that can never run, before yielding anything;
        `StepFailedError` if a step it was in failed; `EngineDeadError` if the engine is dead."""
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = CallerStream(loop, asyncio.Queue(), loop.create_future())
        finished = False
        try:  # the add is inside: a caller cancelled while its add is still queued is aborted too
            self._send(AddRequest(rid, prompt, sampling_params, stream, priority))
            await stream.added  # validation happens in the worker; a refusal raises here
            while not finished:
                out = await stream.outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished and not refused(stream):
                self._send(AbortRequest(rid))

    async def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def check_request(self, prompt: PromptType, sampling_params: SamplingParams | None) -> Unservable | None:
        """Why a request can never run (n too large, prompt too long, pool too small), or None. Changes nothing."""
        seq = self.engine.make_sequence("check", prompt, sampling_params)
        return self.engine.unservable_reason(seq)

    @property
    def is_healthy(self) -> bool:
        """True while the worker thread is alive and the engine has not failed fatally."""
        return self.dead_error is None and self._worker.is_alive()

    def check_health(self) -> None:
        """Raise `EngineDeadError`, saying why, unless the engine can serve requests."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if not self._worker.is_alive():
            raise EngineDeadError("the engine worker thread is not running")

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._worker.join(timeout=30)
        self._die(EngineDeadError("the engine was shut down"))  # fail whoever still waits
        self.engine.shutdown()

    def _send(self, command: Command) -> None:
        with self._lock:
            dead = self.dead_error
            if dead is None:
                self._commands.put(command)
        if dead is not None:
            if isinstance(command, AddRequest):
                raise EngineDeadError(str(dead))
            return  # nothing runs on a dead engine: an abort has nothing left to do
        self._wake.set()

    # --- worker side (the only thread that touches the engine) ----------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_once()
        except BaseException as e:  # anything escaping the loop: nobody would ever answer the callers
            self._die(e)

    def _run_once(self) -> None:
        if self._apply_commands():
            self.stats = self.engine.get_stats()  # aborts free blocks even without a step
        if not self.engine.has_unfinished_requests():
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            return
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise  # fatal: handled by _run
        except Exception as e:  # the step was rolled back (see LLMEngine.step): fail its callers, go on
            return self._fail_step(e)
        # Before the outputs go out: a caller that has its final output, then scrapes /metrics, finds it counted.
        before, self.stats = self.stats, self.engine.get_stats()
        if self.stats.num_steps > before.num_steps:  # a step ran: what it committed is vLLM's iteration tokens
            for observe in self.step_observers:
                observe(self.stats.committed_tokens - before.committed_tokens)
        self._deliver_all(outputs)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            self._record_latency(out, now)
            self._deliver(out.request_id, out)

    def _apply_commands(self) -> bool:
        applied = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return applied
            applied = True
            if isinstance(command, AddRequest):
                self._add(command)
            else:
                self._streams.pop(command.request_id, None)
                try:
                    self.engine.abort_request(command.request_id, report=False)
                except Exception as e:  # the request is gone; a proposer failing to forget it is not fatal
                    self.last_step_error = e

    def _add(self, command: AddRequest) -> None:
        rid, stream = command.request_id, command.stream
        try:
            seq = self.engine.make_sequence(rid, command.prompt, command.sampling_params, command.priority)
            # The sync engine reports an unservable request as an "error" output; a caller of ours
            # learns it before any output, like any other refusal.
            reason = self.engine.unservable_reason(seq)
            if reason is not None:
                raise ValueError(reason.message)
            seq.arrival_time = stream.arrival  # RequestOutput.metrics start where the caller's latencies do
            self.engine.enqueue(seq)
        except Exception as e:
            notify(stream, set_exception, stream.added, e)
            return
        self._streams[rid] = stream
        notify(stream, set_result, stream.added)

    def _fail_step(self, error: Exception) -> None:
        self.last_step_error = error
        message = (f"an engine step failed and was rolled back, or its proposer failed after it "
                   f"({type(error).__name__}: {error}); the requests in it were aborted. The engine keeps "
                   "serving: retry the request")
        self._deliver_all(self.engine.take_pending())  # e.g. the final outputs of a step whose proposer failed
        try:  # before the callers hear of it
            self.engine.abort_request(list(self.engine.requests), report=False)
        except Exception as e:  # the requests are gone; a proposer failing again to forget them is not fatal
            self.last_step_error = e
        self.stats = self.engine.get_stats()  # without them
        for rid in list(self._streams):  # those that were still running
            self._deliver(rid, StepFailedError(message))

    def _die(self, error: BaseException) -> None:
        """Mark the engine dead and fail every caller: queued adds, streams in flight, later adds."""
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(
            f"the engine worker thread died ({type(error).__name__}: {error}); restart the server")
        with self._lock:
            if self.dead_error is None:
                self.dead_error = dead
            queued = []
            while not self._commands.empty():
                queued.append(self._commands.get_nowait())
        for command in queued:
            if isinstance(command, AddRequest):
                notify(command.stream, set_exception, command.stream.added, EngineDeadError(str(dead)))
        streams, self._streams = self._streams, {}
        for stream in streams.values():  # the engine is not touched: its state can't be trusted now
            notify(stream, stream.outputs.put_nowait, EngineDeadError(str(dead)))

    def _record_latency(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        observed: list[tuple[LatencyKind, float]] = []
        if any(c.token_ids for c in out.outputs):
            first = stream.first_token is None
            observed.append(("ttft", now - stream.arrival) if first else ("itl", now - stream.last_token))
            stream.first_token = stream.first_token or now
            stream.last_token = now
        if out.finished:
            observed.append(("e2e", now - stream.arrival))
        for kind, seconds in observed:
            for observe in self.latency_observers:
                observe(kind, seconds)

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[rid]
        if not notify(stream, stream.outputs.put_nowait, item) and rid in self.engine.requests:
            self._streams.pop(rid, None)  # the caller's event loop is closed: nobody will read this
            self.engine.abort_request(rid, report=False)
