"""Building an engine: from an `EngineConfig` to the parts `LLMEngine` wires together.

    checkpoint      config.json -> ModelSpec; refused early if it cannot be sharded as asked
    config          resolved once (engine/resolved_config.py): device, dtype, limits, speculation
    executor        this rank's model and KV pool, and the workers' under tensor parallelism
                    (`UniProcExecutor` / `MultiprocExecutor`, engine/executor/); rank 0's sampler gets
                    the caller's `sampling_filter`, if any (checked on every call: `CheckedFilter`)
    state pool      hybrid models: a recurrent-state slot pair per running request, and with prefix
                    caching the state snapshots' cache (engine/core/state_cache.py)
    block manager   the KV pool's bookkeeping, sized by the executor (every rank agreed on it), with the
                    caller's `block_allocator`, if any (wrapped in `CheckedAllocator`)
    speculator      the proposer `speculative_config` asks for (a draft model loads here)
    scheduler       with the scheduling policy (a caller's own is wrapped in `CheckedPolicy`)
    processors      the request's way in (validation, tokenization) and out (RequestOutputs)

If anything fails after the workers started, they are ended before the error goes up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from minivllm.config import EngineConfig
from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.core.kv_cache_groups import KVBlockManager, KVCacheCoordinator
from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.core.scheduling_policy import get_policy
from minivllm.engine.core.sliding_window import SlidingWindowBlockManager
from minivllm.engine.core.state_cache import StateCache
from minivllm.engine.core.state_pool import StatePool
from minivllm.engine.executor.abstract import Executor
from minivllm.engine.executor.multiproc import MultiprocExecutor
from minivllm.engine.executor.uniproc import UniProcExecutor
from minivllm.engine.processing.input_processor import InputProcessor
from minivllm.engine.processing.output_processor import OutputProcessor
from minivllm.engine.processing.tokenizer import get_tokenizer
from minivllm.engine.resolved_config import ResolvedConfig, resolve_config
from minivllm.engine.spec_decode.speculator import Speculator, build_proposer
from minivllm.engine.worker.loading import compile_decision
from minivllm.engine.worker.state_tensors import StateTensors
from minivllm.models.hf_config import load_model_spec
from minivllm.models.sharding import check_shardable


@dataclass
class EngineParts:
    config: ResolvedConfig
    tokenizer: PreTrainedTokenizerBase
    executor: Executor
    state_pool: StatePool | None
    block_manager: KVBlockManager
    scheduler: Scheduler
    speculator: Speculator | None
    input_processor: InputProcessor
    output_processor: OutputProcessor
    compilation: str  # eager or compiled, and why, in words (logged at start-up; `minivllm bench` prints it)


def build_engine(config: EngineConfig) -> EngineParts:
    model_dir = Path(config.model)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {config.model!r} does not exist; pass a local Hugging Face "
                                "checkpoint folder (config.json + *.safetensors + tokenizer files)")
    spec = load_model_spec(model_dir)
    check_shardable(spec, config.tensor_parallel_size)  # before any process is started
    tokenizer = get_tokenizer(config.tokenizer or config.model)
    resolved = resolve_config(config, spec, tokenizer)
    c = resolved.engine
    input_processor = InputProcessor(tokenizer, spec, c, resolved.device, resolved.eos_token_ids, resolved.reasoning)
    state_pool, state_tensors, cache = None, None, None
    if spec.linear_attn:  # (before the executor: on a GPU the KV pool is sized from what is left)
        d, snapshots = resolved.num_speculative_tokens, resolved.state_cache
        # the tensors for the runner, the books (integers) for the scheduler: engine/request/state_layout.py
        state_tensors = StateTensors(spec, c.max_num_seqs, d, snapshots.num_snapshots if snapshots else 0,
                                     resolved.dtype, resolved.device)
        cache = StateCache(snapshots, c.block_size) if snapshots is not None else None
        state_pool = StatePool(c.max_num_seqs, d, cache)
    executor = (MultiprocExecutor(resolved) if c.tensor_parallel_size > 1
                else UniProcExecutor(resolved, state_tensors))
    try:
        runner = executor.runner
        if c.sampling_filter is not None:  # sampling is rank 0's alone; the Triton sampler refuses one
            runner.sampler.set_filter(c.sampling_filter)
        compilation = compile_decision(runner.model, c, resolved.device)[1]
        if runner.cuda_graphs is not None:
            compilation += f"; decode steps replay CUDA graphs {runner.cuda_graphs.sizes}"
        speculator = None
        if resolved.speculative is not None:
            proposer = build_proposer(resolved.speculative, resolved, runner.num_blocks)
            # drafts are checked like a request's token ids
            speculator = Speculator(resolved.speculative, proposer, input_processor.check_token_ids, spec.vocab_size)
    except BaseException:  # e.g. a draft model that fails to load: the workers must not outlive us
        executor.shutdown()
        raise
    block_manager: KVBlockManager = BlockManager(runner.num_blocks, c.block_size, c.enable_prefix_caching,
                                                 c.block_allocator, state_cache=cache)
    if runner.num_sliding_blocks:  # a second KV-cache group, with a pool (and an LRU allocator) of its own
        block_manager = KVCacheCoordinator(block_manager, SlidingWindowBlockManager(
            runner.num_sliding_blocks, c.block_size, spec.sliding_window, c.enable_prefix_caching))
    scheduler = Scheduler(
        block_manager, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=c.max_model_len, eos_token_ids=resolved.eos_token_ids,
        enable_chunked_prefill=c.enable_chunked_prefill, max_admission_skips=c.max_admission_skips,
        state_pool=state_pool, policy=get_policy(c.scheduling_policy))
    return EngineParts(resolved, tokenizer, executor, state_pool, block_manager, scheduler, speculator,
                       input_processor, OutputProcessor(tokenizer), compilation)
