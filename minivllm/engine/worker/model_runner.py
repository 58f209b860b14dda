"""`ModelRunner`: one rank's model and KV pool; turns a plan into tensors, runs the model, samples.

One step, three phases (vLLM's names):
  1. `prepare_inputs` (rank 0): pack every scheduled chunk into one flat varlen batch, `StepInputs`
       input_ids, positions           (T,)   the new tokens and their positions
       slot_mapping                   (T,)   where each new token's K/V is stored
       cu_seqlens_q, context_lens     (B+1,), (B,)
       block_tables                   (B, max_blocks)
       (sliding-window layers: their own slot_mapping and block_tables, `meta.sliding`)
       logits_indices                 (S,)   the rows whose logits are sampled: the last row of
                                             each chunk that reaches the end of its sequence
                                             (see engine/worker/sampling_metadata.py for drafts and
                                             prompt logprobs)
  2. `forward` (every rank, and the draft model's runner): hidden states for all T rows, logits only
     for the S sampled rows (the LM head is the biggest matmul of a small model; a prefill chunk needs
     only its last row). Under tensor parallelism every rank runs it on its shard, the model's
     collectives keep them in step and the logits are gathered on rank 0.
  3. `sample` (rank 0): logprobs from the raw logits (if asked), then the logits processors
     (penalties, biases, masks: `layers/logits_processors.py`), then every row with its own
     parameters in one sampler call (`layers/sampler.py`), and drafts verified.

It keeps no per-request state: everything comes from the `SchedulerOutput`, so a failed step leaves
nothing behind here (the K/V it wrote land in slots the engine treats as uncomputed). It knows nothing
of executors: `execute_model` runs the forward inside whatever context the executor hands it (a
tensor-parallel executor's sends the step to the workers first: engine/executor/).
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import NamedTuple

import torch

from minivllm.cpu.tuner import Tuning
from minivllm.engine.request.step_types import ModelRunnerOutput, RowGroupOutput, SchedulerOutput
from minivllm.engine.spec_decode.rejection_sampler import Verifier, verify_drafts
from minivllm.engine.worker.cuda_graphs import CUDAGraphRunner
from minivllm.engine.worker.expert_load import ExpertLoad
from minivllm.engine.worker.hybrid_inputs import linear_attn_metadata, linear_attn_slots
from minivllm.engine.worker.kv_cache import allocate_kv_cache
from minivllm.engine.worker.loading import RankModel
from minivllm.engine.worker.sampling_metadata import (OnPromptLogits, SamplingBatch, gather_logprobs, prompt_logits,
                                                      record_prompt_logprobs)
from minivllm.engine.worker.sliding_inputs import sliding_metadata
from minivllm.engine.worker.state_tensors import StateTensors
from minivllm.engine.worker.step_inputs import StepInputs
from minivllm.engine.worker.warmup import measure_cpu_kernels
from minivllm.layers.attention import AttentionMetadata
from minivllm.layers.logits_processors import apply_logits_processing, rows_without_choice
from minivllm.layers.sampler import Sampler, SamplingTensors, TritonSampler
from minivllm.models.compiled_forward import padded_num_tokens

NO_ALLOWED_TOKEN = ("no token is allowed here: the request's rules together forbid every token (its structured_outputs "
                    "grammar, allowed_token_ids, bad_words, or min_tokens, which bans EOS and stop tokens); relax one")


class StepBatch(NamedTuple):
    """A packed step: what every rank's forward needs, and what rank 0 samples with."""

    inputs: StepInputs
    sampling_batch: SamplingBatch  # who each sampled row belongs to, and what it asks
    sampling: SamplingTensors | None  # the sampled rows' parameters as tensors (None: no row sampled)


class ModelRunner:
    """Built by `build_model_runner` (engine/worker/runner_builder.py), the one place that loads the model, picks
    the samplers and turns CUDA graphs on; `rank` is what engine/worker/loading.py loaded for this rank."""

    def __init__(self, rank: RankModel, *, block_size: int, dtype: torch.dtype, device: torch.device,
                 sampler: Sampler | TritonSampler, rejection_sampler: Verifier,
                 eos_token_ids: frozenset[int] = frozenset(), state_tensors: StateTensors | None = None,
                 one_rank: bool = True) -> None:
        model, spec, num_blocks, num_sliding_blocks = rank.model, rank.spec, rank.num_blocks, rank.num_sliding_blocks
        self.model, self.spec, self.backend = model, spec, rank.backend  # spec: this rank's view (its heads)
        self.block_size, self.device = block_size, device
        self.eos_token_ids = eos_token_ids
        self.state_tensors = state_tensors  # hybrid models only: their states, beside kv_cache
        # A compiled model has graphs for a few token counts only; each step is padded up to one of them
        # (models/compiled_forward.py). Padding rows store their K/V in one extra block, `scratch_block`,
        # which the block manager never hands out (it knows `num_blocks` blocks).
        self.compile_sizes: tuple[int, ...] = model.compiled.sizes if model.compiled is not None else ()
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks if self.compile_sizes else None
        self.kv_cache = allocate_kv_cache(spec, num_blocks + bool(self.compile_sizes), block_size, dtype, device)
        self.kv_caches = list(self.kv_cache.unbind(0))  # per layer (2, num_blocks, bs, Hkv, D)
        # Sliding-window layers: a pool of their own (engine/core/kv_cache_groups.py); kv_caches in layer order.
        self.num_sliding_blocks = num_sliding_blocks
        if num_sliding_blocks:
            sliding = spec.sliding_attention_layers
            self.sliding_kv_cache = allocate_kv_cache(spec, num_sliding_blocks, block_size, dtype, device, len(sliding))
            full, window = iter(self.kv_caches), iter(self.sliding_kv_cache.unbind(0))
            self.kv_caches = [next(window) if i in sliding else next(full) for i in spec.attention_layers]
        self.sampler, self.rejection_sampler = sampler, rejection_sampler  # chosen by the backend's type
        self.one_rank = one_rank
        # On a GPU, compiled decode steps of one rank replay CUDA graphs (cuda_graphs.py); None: no graphs.
        self.cuda_graphs: CUDAGraphRunner | None = None  # set by runner_builder.enable_cuda_graphs
        self.expert_load = ExpertLoad(model)  # a mixture of experts: its sparse layers, whose routes each step reports

    # --- one step on one rank, or on every rank inside `on_every_rank` --------------------------
    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput,
                      on_every_rank: Callable[[StepInputs], AbstractContextManager[None]] | None = None
                      ) -> ModelRunnerOutput:
        """Pack, forward, sample. `on_every_rank(inputs)`: the context the forward runs in (a tensor-parallel
        executor's sends `inputs` to the workers, which run the same forward; None: this rank alone)."""
        batch = self.prepare_inputs(plan)
        result = [RowGroupOutput() for _ in plan.scheduled]
        if self.state_tensors is not None:  # rows admitted with a prefix hit start from their snapshot
            self.state_tensors.load([s.state for s in plan.scheduled])
        t0 = time.perf_counter()
        with on_every_rank(batch.inputs) if on_every_rank is not None else nullcontext():
            logits = self.forward(batch.inputs, partial(record_prompt_logprobs, batch.sampling_batch, result))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        forward_s = time.perf_counter() - t0
        self.sample(batch, logits, result)
        if self.state_tensors is not None:  # a verification publishes the state after its accepted drafts
            self.state_tensors.keep_accepted(plan.scheduled, result)
        return ModelRunnerOutput(result, forward_s, self.expert_load.read())

    # --- 1. pack ---------------------------------------------------------------------------------
    def prepare_inputs(self, plan: SchedulerOutput) -> StepBatch:
        # Packed in Python arrays, each turned into a tensor once: a few tensor calls a step whatever the
        # batch (each costs µs of fixed overhead on CPU, where this runs between forwards).
        bs = self.block_size
        input_ids, positions, slots = array("i"), array("q"), array("q")
        query_lens, context_lens, tables = [], [], []
        sb = SamplingBatch()
        row = 0
        for i, (seq, start, n, spec) in enumerate((s.seq, s.start, s.num_new_tokens, s.num_spec_tokens)
                                                  for s in plan.scheduled):
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:start + n - spec])
            input_ids.extend(seq.spec_token_ids[:spec])  # drafts, verified by this step
            # slot = physical block of the position's logical block * block_size + offset in the block
            if n == 1:  # a decode row
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, start + n))
                slots.extend([table[p // bs] * bs + p % bs for p in range(start, start + n)])
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            sb.add_prompt_rows(i, seq, start, n, row)
            row += n
            if spec:  # the last token and every draft are sampled: verification
                sb.add_verification(i, seq, row - 1 - spec, spec, self.eos_token_ids)
            elif start + n == seq.num_tokens:  # the chunk reaches the end: sample its last row
                sb.add_sampled(i, seq, row - 1, self.eos_token_ids)
        sb.apply_grammar_bitmask(plan.grammar_bitmask, self.eos_token_ids)  # the scheduler filled them
        dev = self.device
        num_padding = padded_num_tokens(self.compile_sizes, row) - row if self.compile_sizes else 0
        if num_padding:  # token 0 at position 0, K/V to slot 0 of the scratch block (see __init__)
            input_ids.extend([0] * num_padding)
            positions.extend([0] * num_padding)
            slots.extend([self.scratch_block * bs] * num_padding)
        width = max(map(len, tables))
        flat_tables = array("i")
        for t in tables:  # padded with 0 (attention masks what is past each context)
            flat_tables.extend(t)
            flat_tables.extend([0] * (width - len(t)))
        cu = array("i", [0])
        cu.extend(itertools.accumulate(query_lens))
        meta = AttentionMetadata(
            slot_mapping=torch.frombuffer(slots, dtype=torch.int64).to(dev),
            cu_seqlens_q=torch.frombuffer(cu, dtype=torch.int32).to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_tables=torch.frombuffer(flat_tables, dtype=torch.int32).view(len(tables), width).to(dev),
            query_lens=query_lens, context_lens_host=context_lens, block_size=bs,
        )
        if self.num_sliding_blocks:
            meta.sliding = sliding_metadata(plan.scheduled, meta, self.spec.sliding_window, self.device)
        inputs = StepInputs(
            input_ids=torch.frombuffer(input_ids, dtype=torch.int32).long().to(dev),
            positions=torch.frombuffer(positions, dtype=torch.int64).to(dev), attn_metadata=meta,
            logits_indices=torch.tensor(sb.logits_indices + sb.prompt_indices, dtype=torch.int64, device=dev),
            num_sampled=len(sb.sampled),
            linear_attn=linear_attn_slots(plan.scheduled, dev) if self.state_tensors else None)
        sampling = SamplingTensors.from_params(sb.rows, self.spec.vocab_size, dev) if sb.rows else None
        return StepBatch(inputs, sb, sampling)

    # --- 2. forward (every rank) ---------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inputs: StepInputs, on_prompt_logits: OnPromptLogits | None = None) -> torch.Tensor | None:
        """The model over a packed step; returns the sampled rows' logits (S, V), in the model's dtype, on
        rank 0 (None on a tensor-parallel worker). Prompt rows' logits (prompt logprobs) follow, a chunk at
        a time, each handed to `on_prompt_logits` (engine/worker/sampling_metadata.py `prompt_logits`)."""
        inputs = inputs.to(self.device)
        meta = inputs.attn_metadata
        self.backend.prepare(meta)
        if meta.sliding is not None:
            self.backend.prepare(meta.sliding)
        if self.state_tensors is not None:  # hybrid: linear-attention layers read/write state slots
            state = linear_attn_metadata(inputs.linear_attn, self.state_tensors)
            hidden = self.model(inputs.input_ids, inputs.positions, meta, self.kv_caches, self.backend, state)
        elif self.cuda_graphs is not None and self.cuda_graphs.can_run(len(inputs.input_ids), meta):
            hidden = self.cuda_graphs.run(inputs.input_ids, inputs.positions, meta, self._forward)  # a decode replayed
        else:
            hidden = self._forward(inputs.input_ids, inputs.positions, meta)  # (T, hidden)
        rows, num_sampled = inputs.logits_indices, inputs.num_sampled
        logits = self.model.compute_logits(hidden[rows[:num_sampled]])  # (S, V); a collective under TP
        prompt_logits(self.model, hidden, rows[num_sampled:], on_prompt_logits)  # prompt_logprobs: every rank
        return logits

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.kv_caches, self.backend)  # (T, hidden)

    # --- 3. sample (rank 0) ----------------------------------------------------------------------
    def sample(self, batch: StepBatch, logits: torch.Tensor, result: list[RowGroupOutput]) -> None:
        """Draw every sampled row's token(s) into `result` (one RowGroupOutput per row group)."""
        sb = batch.sampling_batch
        if not sb.sampled:
            return
        want_logprobs = any(r.num_logprobs is not None for r in sb.sampled)
        # Logprobs, logits processing, drafts and random draws compute in float32. A step of greedy rows
        # with none of those needs only each row's argmax, which the sampler takes as it likes
        # (`Sampler.greedy`: on CPU maybe straight from bf16, skipping this copy).
        if (want_logprobs or sb.spec_groups or not batch.sampling.all_greedy
                or not all(r.is_noop for r in sb.processing)):
            logits = logits.float()
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None  # the model's own distribution
        processed = apply_logits_processing(logits, sb.processing)
        stuck = rows_without_choice(processed, sb.processing)  # a grammar against the request's other rules
        tokens = self.sampler(processed, batch.sampling).tolist()
        emitted = verify_drafts(sb, processed, batch.sampling, tokens, self.rejection_sampler)
        for i in stuck:
            if emitted[i] is not None:  # (a verification row past a rejected draft emits nothing: no harm)
                result[sb.sampled[i].entry].error = NO_ALLOWED_TOKEN
        rows = [i for i, tok in enumerate(emitted) if tok is not None]
        logprobs = raw_logprobs[rows] if raw_logprobs is not None else logits[:0]
        picked = gather_logprobs(logprobs, [emitted[i] for i in rows], [sb.sampled[i].num_logprobs for i in rows])
        for i, tok in zip(rows, picked):
            result[sb.sampled[i].entry].tokens.append(tok)

    # --- around the step -------------------------------------------------------------------------
    def measure_cpu_kernels(self, tuning: Tuning = "cached") -> list[str]:
        """Choose the CPU kernels on this machine (tuning cache or timing); say what was chosen (warmup.py)."""
        return measure_cpu_kernels(self.model, self.spec, self.backend, self.sampler, self.kv_cache.dtype,
                                   self.block_size, self.device, tuning)
