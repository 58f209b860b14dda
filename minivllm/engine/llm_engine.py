"""`LLMEngine`: requests in, `RequestOutput`s out; each `step()` is vLLM v1's three calls.

    add_request ──> Sequence ──> Scheduler.waiting
    step():  scheduler.schedule()                       -> SchedulerOutput: who runs, how many tokens each
             executor.execute_model(scheduler_output)   -> ModelRunnerOutput: one forward, then sampling
             scheduler.update_from_output(...)          -> the one commit: tokens, stop rules, frees
             then: RequestOutputs for what changed, drafts proposed for the next step

The step is a transaction (engine/request/journal.py): it begins before `schedule()`, which reserves blocks
and may preempt, each write noting what it replaced. If `execute_model` raises, the step is rolled back to where
it was before planning and bisected to find the request to blame (engine/recovery.py); a plug-in's
failure in `schedule()` (a scheduling policy) is rolled back and raised. Once `execute_model` has
returned, the transaction commits: the plan's reservations are final, and `update_from_output` applies
the results request by request, each request's failure its own (its tokens were appended: there is no
going back, only forward). How failures are contained: engine/request/errors.py and docs/concepts/failures.md.

A request for n > 1 completions is n plain sequences from its arrival (`enqueue`,
engine/processing/parallel_sampling.py), sharing the prompt's blocks through the prefix cache.

A request that can never run (engine/processing/input_processor.py) finishes at once with finish_reason "error"
and the limit to change. A proposer's failure after the commit is its own: the error is raised, and the
step's outputs are held for the next step (or `take_pending`). A request whose output cannot be made
(`OutputProcessor.output` raised) ends with finish_reason "error"; the others are reported as usual.
"""

from __future__ import annotations

import gc
import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from minivllm.config import EngineConfig
from minivllm.engine.builder import build_engine
from minivllm.engine.metrics.stats import EngineCounters, EngineStats, engine_stats
from minivllm.engine.metrics.trace import StepTrace, record_step
from minivllm.engine.processing.input_processor import PromptType, Unservable
from minivllm.engine.processing.output_processor import RequestState
from minivllm.engine.processing.parallel_sampling import fan_out
from minivllm.engine.recovery import StepRecovery
from minivllm.engine.request.errors import RequestsFailedError
from minivllm.engine.request.sequence import FinishReason, Sequence
from minivllm.engine.request.step_types import CommitResult, ModelRunnerOutput, SchedulerOutput
from minivllm.engine.worker.model_runner import ModelRunner
from minivllm.layers.sampler import noise_seed
from minivllm.models.interface import CausalLM
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic garbage collection inside. A start builds long-lived objects by the hundred thousand
    (the tokenizer's, the model's, the tuning's) and little garbage: each full collection the allocations
    set off walks every object Python holds, imports included (0.3 s of CPU in a default-model start on
    a Zen 4; 0.15 s with only the engine's own collection at the end). Restores what it found: a caller
    that disabled the collector keeps it disabled."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        with gc_paused():  # one collection at the end of the start, not one every few thousand objects
            parts = build_engine(config)
            self.resolved = r = parts.config
            self.config, self.spec, self.device, self.dtype, self.eos_token_ids = r.engine, r.spec, r.device, r.dtype, \
                r.eos_token_ids
            self.tokenizer, self.executor, self.state_pool = parts.tokenizer, parts.executor, parts.state_pool
            self.block_manager, self.scheduler, self.speculator = parts.block_manager, parts.scheduler, parts.speculator
            self.input_processor, self.output_processor = parts.input_processor, parts.output_processor
            self.compilation = parts.compilation
            self.recovery = StepRecovery(self.scheduler, self.executor)
            self.requests: dict[str, RequestState] = {}  # unfinished requests by id
            self._pending: list[RequestOutput] = []  # refused/aborted requests, reported by the next step
            self._arrivals = itertools.count()
            self.counters = EngineCounters()
            self.trace: list[StepTrace] = []  # filled when config.record_trace
            self._gc_frozen = False
            if self.config.warmup:  # the CPU kernels chosen by timing, the first steps run (engine/worker/warmup.py)
                self.executor.warmup(self.config.tuning)
                gc.collect()  # (it runs while automatic collection is paused)
                gc.freeze()  # long-lived objects (model, tokenizer) leave the GC's scans: shorter pauses
                self._gc_frozen = True
                self._unfreeze = weakref.finalize(self, gc.unfreeze)  # also if the engine is dropped,
                # but not at exit: unfrozen, the heap is walked by every collection of the interpreter's teardown
                # (~0.7 s of CPU after a default-model start on a Zen 4, against ~0.3 s left frozen)
                self._unfreeze.atexit = False

    @classmethod
    def from_engine_args(cls, model: str, **kwargs: object) -> "LLMEngine":  # vLLM's name
        return cls(EngineConfig(model=model, **kwargs))

    @property
    def model_runner(self) -> ModelRunner:
        """Rank 0's model runner (it packs and samples; every rank runs the forward)."""
        return self.executor.runner

    @property
    def model(self) -> CausalLM:
        return self.executor.runner.model

    # --- requests --------------------------------------------------------------------------------
    def make_sequence(self, request_id: str, prompt: PromptType,
                      sampling_params: SamplingParams | None = None, priority: int = 0) -> Sequence:
        """Validate a request and build its Sequence without touching engine state (its arrival
        order and default seed are assigned by `enqueue`)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.input_processor.make_sequence(request_id, prompt, sampling_params, priority)

    def add_request(self, request_id: str, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        """Queue a request. `priority` matters only with scheduling_policy="priority" (lower = sooner)."""
        self.enqueue(self.make_sequence(request_id, prompt, sampling_params, priority))

    def enqueue(self, seq: Sequence) -> None:
        """Queue a validated request: its seed, its n sequences (n > 1: `fan_out`), its output state."""
        seq.arrival_index = next(self._arrivals)
        seq.arrival_time = seq.arrival_time or time.perf_counter()  # AsyncLLMEngine gives its caller's
        if seq.sampling_params.seed is None:  # unseeded: still reproducible for a given engine seed
            seq.seed = noise_seed(self.config.seed, seq.arrival_index)
        seqs = fan_out(seq)
        state = self.output_processor.new_request(seqs)
        error = self.unservable_reason(seq)
        if error is not None:
            for s in seqs:
                s.finish(FinishReason.ERROR, error=error.message)
            self._pending.append(self.output_processor.output(state))
            return
        self.requests[seq.group_id] = state
        for s in seqs:
            self.scheduler.add_sequence(s)

    def unservable_reason(self, seq: Sequence) -> Unservable | None:
        """Which limit makes this request impossible to run, and what to change; None if it fits."""
        return self.input_processor.unservable_reason(seq, self.block_manager)

    def abort_request(self, request_id: str | Iterable[str], *, report: bool = True) -> None:
        """Finish requests with finish_reason "abort" and free their blocks; unless `report` is
        False, the next `step()` returns their final outputs. Unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ABORT)
            if report:
                self._pending.append(self.output_processor.output(state))
            else:  # no output will be counted for it (a server's caller gone): vllm:request_success's "abort"
                self.counters.count_finished([FinishReason.ABORT.value])
        self._after_commit()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # --- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule() -> execute_model() -> update_from_output(); one output per request that changed. The
        transaction begins before schedule(), rolls back (and bisects) if execute_model raises, and
        commits when it returns, before update_from_output applies the results."""
        outputs, self._pending = self._pending, []
        if not self.scheduler.is_finished():
            with self._reported_later_if_it_raises(outputs):
                self._step(outputs)
        return self._counted(outputs)

    def _step(self, outputs: list[RequestOutput]) -> None:
        t0 = time.perf_counter()
        self.scheduler.begin_step()  # the transaction: what schedule() changes can be rolled back
        try:
            scheduler_output = self.scheduler.schedule()
        except BaseException:  # a scheduling policy's failure, not a request's: undo, raise
            self.scheduler.rollback_step()
            raise
        if scheduler_output.is_empty:  # nothing could run (every candidate preempted or waiting): no forward
            self.scheduler.commit_step()
            return self._after_commit()
        masks = scheduler_output.grammar_bitmask
        if masks is not None and masks.failures:  # a grammar failed or ran over its budget while planning:
            failed = RequestsFailedError(dict(masks.failures))  # those end, rolled back, nothing runs
            outputs.extend(self._report(self.recovery.recover(scheduler_output, failed)))
            return self._after_commit()
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except Exception as error:  # rolled back and bisected: the culprits finish with the error
            outputs.extend(self._report(self.recovery.recover(scheduler_output, error)))
            return self._after_commit()
        except BaseException:  # KeyboardInterrupt and the like: undo, never bisect
            self.scheduler.rollback_step(scheduler_output)
            raise
        self.scheduler.commit_step()  # the forward succeeded: the plan's reservations are final
        committed = self.scheduler.update_from_output(scheduler_output, runner_output)
        published = self._publish(committed)
        outputs.extend(published)
        if self.config.record_trace:
            self.trace.append(record_step(self.counters.num_steps, scheduler_output, self.scheduler,
                                          [o.request_id for o in published if o.finished], runner_output))
        try:
            self._after_commit(scheduler_output, runner_output)  # drafts for the next step, too
        finally:
            self.counters.count_step(scheduler_output.num_prefill_tokens, scheduler_output.num_decode_tokens,
                                     runner_output.forward_time_s, time.perf_counter() - t0, runner_output.expert_load)

    def _publish(self, committed: CommitResult) -> list[RequestOutput]:
        """After the commit: tokens are counted, the changed requests' outputs made."""
        self.counters.num_generation_tokens_total += committed.num_generation_tokens
        self.counters.num_prompt_tokens_total += committed.num_prompt_tokens
        return self._report([g for g in committed.changed if g in self.requests], only_changed=True)

    def _report(self, group_ids: list[str], only_changed: bool = False) -> list[RequestOutput]:
        """The requests' outputs now (FINAL_ONLY requests: only when finished); finished ones leave."""
        outputs = []
        for group_id in group_ids:
            state = self.requests[group_id]
            if state.finished:
                del self.requests[group_id]
            elif only_changed and state.seqs[0].sampling_params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            try:
                outputs.append(self.output_processor.output(state))
            except Exception as error:  # making its output failed (its text, its logprobs): it fails alone
                outputs.append(self._failed_output(group_id, state, error))
        return outputs

    def _failed_output(self, group_id: str, state: RequestState, error: Exception) -> RequestOutput:
        """A request whose output could not be made ends with finish_reason "error" (a finished one too:
        its final output is what failed) and leaves; its bare output names the error."""
        message = f"making this request's output failed: {type(error).__name__}: {error}"
        for seq in state.seqs:
            self.scheduler.finish(seq, FinishReason.ERROR, error=message)
        self.requests.pop(group_id, None)
        return self.output_processor.failed_output(state, message)

    def take_pending(self) -> list[RequestOutput]:
        """The outputs held for the next step (refused or aborted requests, or those of a step whose proposer
        failed after its commit), taken: a caller that will not step again delivers them itself."""
        pending, self._pending = self._pending, []
        return self._counted(pending)

    @contextmanager
    def _reported_later_if_it_raises(self, outputs: list[RequestOutput]) -> Iterator[None]:
        """What this step has to report goes out with the next one if the step raises."""
        try:
            yield
        except BaseException:
            self._pending = outputs + self._pending
            raise

    def _after_commit(self, scheduler_output: SchedulerOutput | None = None,
                      runner_output: ModelRunnerOutput | None = None) -> None:
        """Once the scheduler's state is final: the proposer learns what the step verified and which
        sequences gave their blocks back, then drafts for the next step. If it raises, that is its
        failure, not a request's: the step stands, and the error is raised."""
        released = self.scheduler.take_released()
        if self.speculator is not None:
            self.speculator.after_step(scheduler_output, runner_output, released)
            if scheduler_output is not None:
                drafts = self.speculator.propose(self.scheduler.running, self.scheduler.draft_room)
                self.scheduler.update_draft_token_ids(drafts)

    def _counted(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        self.counters.count_finished(o.outputs[0].finish_reason for o in outputs if o.finished)
        return outputs

    # --- introspection and shutdown ----------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return engine_stats(self.counters, self.block_manager, self.scheduler, self.speculator)

    def collective_rpc(self, method: Callable[[int, ModelRunner], T]) -> list[T]:
        """Run `method(rank, model_runner)` on every rank, results in rank order (vLLM's name): e.g. to
        look at each rank's shard. `method` must pickle (a module-level function) and must not raise:
        like a step, an exception on any rank ends a tensor-parallel engine (EngineDeadError)."""
        return self.executor.collective_rpc(method)

    def shutdown(self) -> None:
        """Abort what is left, undo gc.freeze() (which moved the heap out of the collector's sight),
        and end the tensor-parallel workers. Safe to call twice."""
        self.abort_request(list(self.requests), report=False)
        self._pending.clear()
        if self._gc_frozen:
            self._unfreeze()
            self._gc_frozen = False
        self.executor.shutdown()
