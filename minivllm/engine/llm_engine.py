"""`LLMEngine`: the loop that ties the four core classes together.

    add_request ──> Sequence ──> Scheduler.waiting
    step():  plan     Scheduler.schedule()          which requests, how many tokens each
             run      ModelRunner.execute_model()   one forward over the flat batch, then sample
             commit   Scheduler.postprocess()       append tokens, publish cached blocks, stop rules
                      detokenize + stop strings     -> RequestOutput for what changed

The step is a transaction. `schedule()` reserves blocks (and may preempt), but nothing is final
until the commit: every change is recorded in an undo log (engine/undo_log.py), and if the forward
pass or the sampler raises, the scheduler and the block manager are rolled back to where they were
before planning. A free cached block that the failed step overwrote loses its hash, so a
half-written block can never be served from the prefix cache.

A request can only fail itself (the failure model, engine/errors.py):
  * a failed step is re-run in halves (bisection) to find the culprit: a request whose failure
    reproduces when it runs alone finishes with finish_reason "error" and the message, and the
    others continue with exactly the tokens they would have drawn without it (seeded noise);
  * a failure that no single request reproduces is rolled back and re-raised, as is;
  * device errors (CUDA) and failed collectives raise `EngineDeadError`: nothing is re-run;
    under tensor parallelism, so does any failure while the ranks run a step together (a worker that
    dies, raises or hangs: distributed/executor.py);
  * the commit (appending tokens, detokenizing, stop strings) runs request by request: an exception
    there finishes that request with an error and leaves no half-finished entry behind.

Requests that can never run (more completions than max_num_seqs, longer than max_model_len, or needing
more KV blocks than the whole pool) finish at once with finish_reason "error" and a message saying
which limit to change. A plug-in's failure (the scheduling policy's, the proposer's) is not a
request's: the step is undone and the error raised.
"""

from __future__ import annotations

import collections
import gc
import logging
import sys
import itertools
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from transformers import AutoTokenizer

from minivllm.config import EngineConfig
from minivllm.distributed.executor import MultiprocExecutor
from minivllm.distributed.parallel_state import ParallelContext
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.errors import EngineDeadError, is_fatal
from minivllm.engine.loading import RankModel, compile_decision, load_rank, resolve_device, resolve_dtype
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.input_processor import InputProcessor, PromptType, Unservable
from minivllm.engine.output_processor import OutputProcessor, RequestState
from minivllm.engine.sampling_metadata import RowGroupOutput
from minivllm.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from minivllm.engine.scheduling_policy import get_policy
from minivllm.engine.spec_decode.config import SpeculativeConfig
from minivllm.engine.state_pool import StatePool
from minivllm.engine.spec_decode.speculator import Speculator, build_proposer
from minivllm.engine.sequence import Sequence
from minivllm.engine.stats import EngineStats
from minivllm.engine.trace import StepTrace, record_step
from minivllm.layers.sampler import noise_seed
from minivllm.models.hf_config import ModelSpec, load_model_spec
from minivllm.models.sharding import check_shardable
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {config.model!r} does not exist; pass a local Hugging Face "
                                    "checkpoint folder (config.json + *.safetensors + tokenizer files)")
        self.spec = spec = load_model_spec(model_dir)
        check_shardable(spec, config.tensor_parallel_size)  # before any process is started
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, spec, self.device)
        chosen = (f"minivllm: dtype {str(self.dtype).removeprefix('torch.')} (dtype={config.dtype!r}, checkpoint "
                  f"{spec.dtype}, {self.device.type}), quantization {config.quantization}")
        # Say it on stderr when the machine made the choice (auto picked other than the checkpoint's).
        machine_choice = config.dtype == "auto" and str(self.dtype).removeprefix("torch.") != str(spec.dtype)
        if machine_choice or config.quantization:
            print(chosen, file=sys.stderr)
        else:
            logging.getLogger("minivllm").info(chosen)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        eos = set(spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.config = config = self._resolve_limits(self._hybrid_limits(config, spec))
        # Tensor parallelism: start the workers (this process is rank 0); None with one rank.
        self.executor = MultiprocExecutor(config, self.device) if config.tensor_parallel_size > 1 else None
        try:
            rank = self._load_rank(config, spec)  # this rank's shard (its heads) and the KV pool's size
            self.model, num_blocks = rank.model, rank.num_blocks
            # Eager or compiled (decided in load_rank the same way on every rank), in words.
            self.compilation = compile_decision(self.model, config, self.device)[1]
            # Hybrid models: the linear-attention layers' state pool, one slot pair per running request.
            self.state_pool = (StatePool(spec, config.max_num_seqs, self.dtype, self.device)
                               if spec.linear_attn is not None else None)
            self.model_runner = ModelRunner(self.model, rank.spec, rank.backend, num_blocks=num_blocks,
                                            block_size=config.block_size, dtype=self.dtype, device=self.device,
                                            eos_token_ids=self.eos_token_ids, state_pool=self.state_pool,
                                            executor=self.executor)
            if self.model_runner.cuda_graphs is not None:
                self.compilation += f"; decode steps replay CUDA graphs {self.model_runner.cuda_graphs.sizes}"
            logging.getLogger("minivllm").info("minivllm: forward %s", self.compilation)
            self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
            self.spec_config = (SpeculativeConfig.from_dict(config.speculative_config)
                                if config.speculative_config is not None else None)
            self.speculator = (Speculator(self.spec_config, build_proposer(self.spec_config, self, num_blocks),
                                          self.check_token_ids, spec.vocab_size)
                               if self.spec_config is not None else None)
        except BaseException:  # e.g. a draft model that fails to load: the workers must not outlive us
            if self.executor is not None:
                self.executor.shutdown()
            raise
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            eos_token_ids=self.eos_token_ids, enable_chunked_prefill=config.enable_chunked_prefill,
            max_admission_skips=config.max_admission_skips,
            num_speculative_tokens=self.spec_config.num_speculative_tokens if self.spec_config else 0,
            state_pool=self.state_pool, policy=get_policy(config.scheduling_policy))
        self.input_processor = InputProcessor(self.tokenizer, spec, config, self.device)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, RequestState] = {}  # unfinished requests by id
        self._pending: list[RequestOutput] = []  # refused/aborted requests, reported by the next step
        self._arrivals = itertools.count()
        self._counters = dict(num_steps=0, num_prefill_tokens=0, num_decode_tokens=0, num_mixed_steps=0,
                              step_time_s=0.0, forward_time_s=0.0, num_prompt_tokens_total=0,
                              num_generation_tokens_total=0)
        self._finished: collections.Counter[str] = collections.Counter()  # finish_reason -> requests
        self.trace: list[StepTrace] = []  # filled when config.record_trace
        self._gc_frozen = False
        if config.warmup:
            self.model_runner.warmup()
            gc.collect()
            gc.freeze()  # long-lived objects (model, tokenizer) leave the GC's scans: shorter pauses
            self._gc_frozen = True
            # Also undo it if the engine is simply dropped or the interpreter exits.
            self._unfreeze = weakref.finalize(self, gc.unfreeze)

    @classmethod
    def from_engine_args(cls, model: str, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig(model=model, **kwargs))

    def _load_rank(self, config: EngineConfig, spec: ModelSpec) -> RankModel:
        if self.executor is not None:  # every worker builds its own shard at the same time
            return self.executor.load_rank(config, spec, self.dtype)
        return load_rank(config, spec, self.device, self.dtype, ParallelContext())

    @staticmethod
    def _hybrid_limits(config: EngineConfig, spec: ModelSpec) -> EngineConfig:
        """What a hybrid model (linear-attention layers with a recurrent state) cannot do here."""
        if spec.linear_attn is None:
            return config
        if config.speculative_config is not None:
            raise ValueError(f"{spec.architecture} has linear-attention layers: speculative decoding would have to "
                             "roll their recurrent state back past rejected drafts, which minivllm does not do; "
                             "drop speculative_config")
        if config.enable_prefix_caching:
            # A cached prefix is only usable with the recurrent state at its end, which is not kept.
            print(f"minivllm: prefix caching is off for {spec.architecture}: a cached prefix would need the "
                  "linear-attention state at its end, which minivllm does not keep", file=sys.stderr)
            config = config.replace(enable_prefix_caching=False)
        return config

    def _resolve_limits(self, config: EngineConfig) -> EngineConfig:
        limit = self.spec.max_position_embeddings
        if not config.enable_chunked_prefill:
            limit = min(limit, config.max_num_batched_tokens)
        if config.max_model_len is None:
            return config.replace(max_model_len=limit)
        if config.max_model_len > limit:
            also = "" if config.enable_chunked_prefill else ", or max_num_batched_tokens with chunked prefill off"
            raise ValueError(f"max_model_len={config.max_model_len} exceeds {limit} (the model's "
                             f"max_position_embeddings{also}); lower max_model_len")
        return config

    # --- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def make_sequence(self, request_id: str, prompt: PromptType,
                      sampling_params: SamplingParams | None = None, priority: int = 0) -> Sequence:
        """Validate a request and build its Sequence without touching engine state (its arrival
        order and default seed are assigned by `enqueue`)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.input_processor.make_sequence(request_id, prompt, sampling_params, priority)

    def check_token_ids(self, request_id: str, field: str, ids: Iterable[Any]) -> list[int]:
        return self.input_processor.check_token_ids(request_id, field, ids)

    def add_request(self, request_id: str, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        """Queue a request. `priority` matters only with scheduling_policy="priority" (lower = sooner)."""
        self.enqueue(self.make_sequence(request_id, prompt, sampling_params, priority))

    def enqueue(self, seq: Sequence) -> None:
        seq.arrival_index = next(self._arrivals)
        if seq.sampling_params.seed is None:  # unseeded: still reproducible for a given engine seed
            seq.seed = noise_seed(self.config.seed, seq.arrival_index)
        state = self.output_processor.new_request(seq)
        error = self.unservable_reason(seq)
        if error is not None:
            seq.finish("error", error=error.message)
            self._pending.append(self.output_processor.output(state))
            return
        self.requests[seq.group_id] = state
        self.scheduler.add_sequence(seq)

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
                    self.scheduler.finish(seq, "abort")
            if report:
                self._pending.append(self.output_processor.output(state))
        self._tell_proposer([])

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan, run and commit one step; returns one output per request that changed."""
        outputs = self._step()
        self._finished.update(o.outputs[0].finish_reason for o in outputs if o.finished)
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.scheduler.is_finished():
            return outputs
        t0 = time.perf_counter()
        self.scheduler.begin()
        try:
            plan = self.scheduler.schedule()
            if self.speculator is not None and not plan.is_empty:
                self.speculator.propose(plan, self.scheduler)
        except BaseException:  # a scheduling policy's or the proposer's failure, not a request's: undo, raise
            self.scheduler.rollback()
            self._pending = outputs + self._pending
            raise
        if plan.is_empty:  # nothing could run (every candidate preempted or waiting): no forward to make
            self.scheduler.commit()
            self._tell_proposer(outputs)
            return outputs
        try:
            sampled = self.model_runner.execute_model(plan)
        except Exception as error:
            try:
                outputs.extend(self._recover(plan, error))
            except BaseException:
                self._pending = outputs + self._pending
                raise
            self._tell_proposer(outputs)
            return outputs
        except BaseException:  # KeyboardInterrupt and the like: undo, never bisect
            self.scheduler.rollback(self.model_runner.written_blocks(plan))
            self._pending = outputs + self._pending
            raise
        self.scheduler.commit()
        committed = self._commit(plan, sampled)
        outputs.extend(committed)
        if self.config.record_trace:
            done = [o.request_id for o in committed if o.finished]
            accepted = [max(0, len(o.tokens) - 1) if sch.num_spec_tokens else 0
                        for sch, o in zip(plan.scheduled, sampled)]
            self.trace.append(record_step(self._counters["num_steps"], plan, self.scheduler, done, accepted))
        c = self._counters
        c["num_steps"] += 1
        c["num_prefill_tokens"] += plan.num_prefill_tokens
        c["num_decode_tokens"] += plan.num_decode_tokens
        c["num_mixed_steps"] += bool(plan.num_prefill_tokens and plan.num_decode_tokens)
        c["forward_time_s"] += self.model_runner.last_forward_s
        c["step_time_s"] += time.perf_counter() - t0
        self._tell_proposer(outputs, plan, sampled)
        return outputs

    def _tell_proposer(self, outputs: list[RequestOutput], plan: SchedulerOutput | None = None,
                       sampled: list[RowGroupOutput] | None = None) -> None:
        """After the scheduler's state is final: the proposer learns what the step verified and which
        sequences gave their blocks back. If it raises, that is its failure, not a request's: the
        outputs go out with the next step, and the error is raised."""
        released = self.scheduler.take_released()
        if self.speculator is None:
            return
        try:
            self.speculator.after_step(plan, sampled, released)
        except BaseException:
            self._pending = outputs + self._pending
            raise

    # --- failures ----------------------------------------------------------------------------------
    def _recover(self, plan: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """The step failed: find the requests to blame, roll back, and finish those with an error.
        Raises `error` again when no single request reproduces it; `EngineDeadError` when fatal."""
        written = self.model_runner.written_blocks(plan)  # the trial runs write only these slots too
        try:
            if is_fatal(error):
                raise _dead(error) from error
            culprits = self._blame(plan, plan.scheduled)
        finally:
            self.scheduler.rollback(written)
        if not culprits:
            raise error
        failed: dict[str, RequestState] = {}
        for sched, err in culprits:
            seq = sched.seq
            self.scheduler.finish(seq, "error", error=f"this request made the step fail on its own: "
                                                       f"{type(err).__name__}: {err}")
            failed[seq.group_id] = self.requests[seq.group_id]
        return [self._report(state) for state in failed.values()]

    def _blame(self, plan: SchedulerOutput, group: list[ScheduledSequence]
               ) -> list[tuple[ScheduledSequence, Exception]]:
        """Bisection: re-run `group` (a part of `plan`); if it fails, re-run each half, down to single
        requests. Costs O(culprits x log(batch)) forwards, paid only by a failed step."""
        if not group:
            return []
        try:  # the drafts' proposal distributions go with them: verification must be re-run as it ran
            self.model_runner.execute_model(SchedulerOutput(list(group), draft_probs=plan.draft_probs))
            return []
        except Exception as error:
            if is_fatal(error):
                raise _dead(error) from error
            if len(group) == 1:
                return [(group[0], error)]
        mid = len(group) // 2
        return self._blame(plan, group[:mid]) + self._blame(plan, group[mid:])

    def _count_tokens(self, seq: Sequence, num_new: int, first: bool) -> None:
        """Tokens are counted here, at commit: recomputed or rejected ones never count."""
        c = self._counters
        c["num_generation_tokens_total"] += num_new
        if first and seq.index == 0:
            c["num_prompt_tokens_total"] += seq.num_prompt_tokens

    def _report(self, state: RequestState) -> RequestOutput:
        """The request's output now; a finished request leaves the engine."""
        if state.finished:
            self.requests.pop(state.request_id, None)
        return self.output_processor.output(state)

    # --- the commit --------------------------------------------------------------------------------
    def _commit(self, plan: SchedulerOutput, outputs: list[RowGroupOutput]) -> list[RequestOutput]:
        """Request by request, so that an exception (say, in a tokenizer's decode) fails only the
        sequence it happened in."""
        changed: dict[str, RequestState] = {}
        for sched, row_out in zip(plan.scheduled, outputs):
            seq = sched.seq
            state = self.requests.get(seq.group_id)
            if state is None:
                continue
            current = seq
            try:
                if row_out.prompt_logprobs:
                    seq.prompt_logprobs.extend(row_out.prompt_logprobs)
                result = self.scheduler.postprocess_one(sched, row_out)
                children = result.updated[1:]
                for child in children:  # forked children join their request before anything can fail
                    self.output_processor.add_sequence(state, child)
                try:
                    self.model_runner.copy_blocks(result.blocks_to_copy)
                except EngineDeadError:
                    raise
                except Exception:  # the children's last blocks were never copied: they cannot go on
                    for child in children:
                        if not child.is_finished:
                            self.scheduler.finish(child, "error", error="copying this sequence's blocks failed")
                    raise
                for current in result.updated:
                    first = state.detoks[current.index].num_output_tokens == 0
                    num_new, match = self.output_processor.detokenize(state, current)
                    if match is not None:
                        self.scheduler.finish(current, "stop", match.stop)
                        current.truncate_output(state.detoks[current.index].num_output_tokens)
                    self._count_tokens(current, num_new, first)
                if result.updated:
                    changed[state.request_id] = state
            except EngineDeadError:  # copy-on-write on the workers failed: fatal, not this request's fault
                raise
            except Exception as e:
                error = f"committing this request's token failed: {type(e).__name__}: {e}"
                if not current.is_finished:
                    self.scheduler.finish(current, "error", error=error)
                self._adopt_orphans(state, error)
                changed[state.request_id] = state
        return [self._report(state) for state in changed.values()
                if state.finished or state.seqs[0].sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY]

    def _adopt_orphans(self, state: RequestState, error: str) -> None:
        """After a failed commit: a sequence of this request that the scheduler runs but the request does
        not know (a child forked before the failure, not yet handed over) would run for nobody, holding
        its blocks. It joins its request and finishes with the same error."""
        known = {id(s) for s in state.seqs}
        orphans = [s for s in self.scheduler.live_sequences if s.group_id == state.request_id and id(s) not in known]
        for seq in sorted(orphans, key=lambda s: s.index):
            self.output_processor.add_sequence(state, seq)
            self.scheduler.finish(seq, "error", error=error)

    # --- introspection and shutdown ----------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm, c = self.block_manager, self._counters
        return EngineStats(
            num_steps=c["num_steps"], num_prefill_tokens=c["num_prefill_tokens"],
            num_decode_tokens=c["num_decode_tokens"], num_mixed_steps=c["num_mixed_steps"],
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.num_queried_tokens, prefix_cache_hits=bm.num_hit_tokens,
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            step_time_s=c["step_time_s"], forward_time_s=c["forward_time_s"],
            num_prompt_tokens_total=c["num_prompt_tokens_total"],
            num_generation_tokens_total=c["num_generation_tokens_total"], finished_requests=dict(self._finished),
            **self._spec_stats())

    def _spec_stats(self) -> dict[str, Any]:
        sp = self.speculator
        if sp is None:
            return {}
        return dict(num_drafts=sp.per_position[0][0] if sp.per_position else 0,
                    num_draft_tokens=sp.num_draft_tokens, num_accepted_tokens=sp.num_accepted_tokens,
                    num_accepted_tokens_per_pos=tuple(a for _, a in sp.per_position),
                    acceptance_per_position=sp.acceptance_per_position)

    def collective_rpc(self, method: Callable[[int, ModelRunner], T]) -> list[T]:
        """Run `method(rank, model_runner)` on every rank, results in rank order (vLLM's name): e.g. to
        look at each rank's shard. `method` must pickle (a module-level function) and must not raise:
        like a step, an exception on any rank ends a tensor-parallel engine (EngineDeadError)."""
        if self.executor is None:
            return [method(0, self.model_runner)]
        return self.executor.collective_rpc(method, lambda: method(0, self.model_runner))

    def shutdown(self) -> None:
        """Abort what is left, undo gc.freeze() (which moved the heap out of the collector's sight),
        and end the tensor-parallel workers. Safe to call twice."""
        self.abort_request(list(self.requests), report=False)
        self._pending.clear()
        if self._gc_frozen:
            self._unfreeze()
            self._gc_frozen = False
        if self.executor is not None:
            self.executor.shutdown()


def _dead(error: Exception) -> EngineDeadError:
    if isinstance(error, EngineDeadError):
        return error  # it says what happened already (e.g. which worker failed, and how)
    return EngineDeadError(f"the engine hit a device error and must be restarted: {error}")
