"""`ModelRunner`: turns the scheduler's plan into tensors, runs the model, samples.

One step, three phases:
  1. `prepare_inputs`: pack every scheduled chunk into one flat varlen batch
       input_ids, positions           (T,)   the new tokens and their positions
       slot_mapping                   (T,)   where each new token's K/V is stored
       cu_seqlens_q, context_lens     (B+1,), (B,)
       block_tables                   (B, max_blocks)
       logits_indices                 (S,)   the rows whose logits are sampled: the last row of
                                             each chunk that reaches the end of its sequence
                                             (see engine/sampling_metadata.py for forks and
                                             prompt logprobs)
  2. forward: hidden states for all T rows, logits only for the S sampled rows (the LM head is the
     biggest matmul of a small model; a prefill chunk needs only its last row).
  3. sample: logprobs from the raw logits (if asked), then the logits processors (penalties,
     biases, masks: `layers/logits_processors.py`), then every row with its own parameters in one
     sampler call (`layers/sampler.py`).

It keeps no per-request state: everything comes from the `SchedulerOutput`, so a failed step
leaves nothing behind here (the K/V it wrote land in slots the engine treats as uncomputed).

Tensor parallelism: this runner is rank 0's. Between packing and sampling, `executor.run` sends the
packed batch (`StepInputs`) to the workers, which run the same forward on their shards; the model's
collectives keep the ranks in step and `compute_logits` gathers the whole vocabulary here
(distributed/executor.py). Packing and sampling stay on rank 0 alone.
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minivllm.distributed.communication import CopyBlocks, StepInputs
from minivllm.engine.cuda_graphs import Capture, CUDAGraphRunner, cuda_graph_capture
from minivllm.engine.kv_cache import allocate_kv_cache
from minivllm.engine.sampling_metadata import PromptLogprob, RowGroupOutput, SamplingBatch, gather_logprobs
from minivllm.engine.spec_decode.rejection_sampler import RejectionSampler, TritonRejectionSampler, verify_drafts
from minivllm.engine.scheduler import ScheduledSequence, SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.engine.state_pool import StatePool
from minivllm.layers.attention import AttentionBackend, AttentionMetadata
from minivllm.layers.linear_attn_metadata import LinearAttnMetadata
from minivllm.layers.logits_processors import apply_logits_processing
from minivllm.layers.sampler import Sampler, SamplingTensors, TritonSampler
from minivllm.models.compiled_forward import padded_num_tokens
from minivllm.models.hf_config import ModelSpec
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.distributed.executor import MultiprocExecutor

PROMPT_LOGPROBS_CHUNK = 256  # prompt rows whose logits and log-softmax exist at once (prompt_logprobs)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (S,)
    sampling_batch: SamplingBatch  # who each sampled row belongs to, and what it asks
    sampling: SamplingTensors | None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, backend: AttentionBackend, *, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device,
                 eos_token_ids: frozenset[int] = frozenset(), state_pool: StatePool | None = None,
                 executor: MultiprocExecutor | None = None) -> None:
        self.model, self.spec, self.backend = model, spec, backend  # spec: this rank's view (its heads)
        self.block_size, self.device = block_size, device
        self.eos_token_ids = eos_token_ids
        self.state_pool = state_pool  # hybrid models only (engine/state_pool.py)
        self.executor = executor  # tensor parallelism: rank 0's handle on the workers (None: one rank)
        # A compiled model has graphs for a few token counts only; each step is padded up to one of them
        # (models/compiled_forward.py). Padding rows store their K/V in one extra block, `scratch_block`,
        # which the block manager never hands out (it knows `num_blocks` blocks).
        compiled = getattr(model, "compiled", None)
        self.compile_sizes: tuple[int, ...] = compiled.sizes if compiled is not None else ()
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks if self.compile_sizes else None
        self.kv_cache = allocate_kv_cache(spec, num_blocks + bool(self.compile_sizes), block_size, dtype, device)
        self.kv_caches = list(self.kv_cache.unbind(0))  # per layer (2, num_blocks, bs, Hkv, D)
        triton = backend.name == "triton"
        self.sampler = TritonSampler() if triton else Sampler()
        self.rejection_sampler = TritonRejectionSampler() if triton else RejectionSampler()
        self.last_forward_s = 0.0  # time of the latest model forward + LM head (for overhead stats)
        # On a GPU, compiled decode steps replay CUDA graphs (engine/cuda_graphs.py); None: no graphs.
        self.cuda_graphs: CUDAGraphRunner | None = None
        if (self.compile_sizes and device.type == "cuda" and backend.supports_cuda_graphs and state_pool is None
                and executor is None):
            self.enable_cuda_graphs(cuda_graph_capture(torch.cuda.graph_pool_handle()))

    def enable_cuda_graphs(self, capture: Capture) -> None:
        """Decode steps of the compiled sizes run as recorded graphs from now on (`capture` records one;
        tests on CPU pass `cuda_graphs.replay_by_rerun`). Needs the scratch block of a compiled model."""
        if (self.scratch_block is None or not self.backend.supports_cuda_graphs or self.executor is not None
                or self.state_pool is not None):
            raise ValueError("CUDA graphs need the compiled forward (enforce_eager=False), the Triton attention "
                             "backend, one rank and a model without linear-attention layers")
        max_blocks = min(self.num_blocks, -(-self.spec.max_position_embeddings // self.block_size))
        self.cuda_graphs = CUDAGraphRunner(self.compile_sizes, max_blocks_per_seq=max_blocks,
                                           scratch_block=self.scratch_block, block_size=self.block_size,
                                           backend=self.backend, device=self.device, capture=capture)

    # --- 1. pack ---------------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> StepBatch:
        # Packed in Python arrays, each turned into a tensor once: a few tensor calls a step whatever the
        # batch (each costs µs of fixed overhead on CPU, where this runs between forwards).
        bs = self.block_size
        input_ids, positions, slots = array("i"), array("q"), array("q")
        query_lens, context_lens, tables = [], [], []
        sb = SamplingBatch()
        row = 0
        for i, (seq, start, n, spec) in enumerate(out.scheduled):
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
                sb.add_verification(i, seq, row - 1 - spec, self.eos_token_ids, out.draft_probs.get(seq.request_id))
            elif start + n == seq.num_tokens:  # the chunk reaches the end: sample its last row
                sb.add_sampled(i, seq, row - 1, self.eos_token_ids)
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
        self.backend.prepare(meta)
        sampling = SamplingTensors.from_params(sb.rows, self.spec.vocab_size, dev) if sb.rows else None
        return StepBatch(
            input_ids=torch.frombuffer(input_ids, dtype=torch.int32).long().to(dev),
            positions=torch.frombuffer(positions, dtype=torch.int64).to(dev), attn_metadata=meta,
            logits_indices=torch.tensor(sb.logits_indices + sb.prompt_indices, dtype=torch.int64, device=dev),
            sampling_batch=sb, sampling=sampling,
        )

    # --- 2 + 3. run and sample ------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> list[RowGroupOutput]:
        """Run one step; returns what each scheduled row group produced (maybe nothing)."""
        batch = self.prepare_inputs(out)
        sb = batch.sampling_batch
        t0 = time.perf_counter()
        with self._on_every_rank(batch):  # tensor parallelism: the workers run this forward too
            if self.state_pool is not None:  # hybrid: linear-attention layers read/write state slots
                state = self._linear_attn_metadata(out)
                hidden, _ = self.model(batch.input_ids, batch.positions, batch.attn_metadata, self.kv_caches,
                                       self.backend, state)  # (T, hidden); new states are in the staging slots
            elif self.cuda_graphs is not None and self.cuda_graphs.can_run(len(batch.input_ids), batch.attn_metadata):
                hidden = self.cuda_graphs.run(batch.input_ids, batch.positions, batch.attn_metadata,
                                              self._forward)  # (T, hidden), a decode step replayed
            else:
                hidden = self._forward(batch.input_ids, batch.positions, batch.attn_metadata)  # (T, hidden)
            num_sampled = len(sb.sampled)
            if sb.prompt_rows and self.executor is None:  # prompt rows' logits later, a chunk at a time
                logits = self.model.compute_logits(hidden[batch.logits_indices[:num_sampled]])  # (S, V)
                prompt_hidden = hidden[batch.logits_indices[num_sampled:]]  # (P, hidden)
                prompt_logits = partial(_rows_logits, self.model, prompt_hidden)
            else:  # every rank gathers the same logits once (tensor parallelism: a collective)
                logits = self.model.compute_logits(hidden[batch.logits_indices])  # (S + P, V)
                prompt_logits = logits[num_sampled:].__getitem__
        result = [RowGroupOutput() for _ in out.scheduled]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - t0
        if sb.prompt_rows:
            self._record_prompt_logprobs(prompt_logits, sb, result)
        if not num_sampled:
            return result
        logits = logits[:num_sampled]  # (S, V), in the model's dtype
        want_logprobs = any(r.num_logprobs is not None for r in sb.sampled)
        # Logprobs, logits processing, drafts and random draws compute in float32. A step of greedy rows
        # with none of those needs only each row's argmax, which the sampler takes as it likes
        # (`Sampler.greedy`: on CPU maybe straight from bf16, skipping this copy).
        if (want_logprobs or sb.spec_groups or not batch.sampling.all_greedy
                or not all(r.is_noop for r in sb.processing)):
            logits = logits.float()
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None  # the model's own distribution
        processed = apply_logits_processing(logits, sb.processing)
        tokens = self.sampler(processed, batch.sampling).tolist()
        emitted = verify_drafts(sb, processed, batch.sampling, tokens, self.rejection_sampler)
        rows = [i for i, tok in enumerate(emitted) if tok is not None]
        logprobs = raw_logprobs[rows] if raw_logprobs is not None else logits[:0]
        picked = gather_logprobs(logprobs, [emitted[i] for i in rows], [sb.sampled[i].num_logprobs for i in rows])
        for i, tok in zip(rows, picked):
            r = sb.sampled[i]
            (result[r.entry].fork_tokens if r.is_fork else result[r.entry].tokens).append(tok)
        return result

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.kv_caches, self.backend)  # (T, hidden)

    def _on_every_rank(self, batch: StepBatch) -> AbstractContextManager[None]:
        if self.executor is None:
            return nullcontext()
        return self.executor.run(StepInputs.pack(batch.input_ids, batch.positions, batch.attn_metadata,
                                                 batch.logits_indices))

    @staticmethod
    def _record_prompt_logprobs(prompt_logits: Callable[[slice], torch.Tensor], sb: SamplingBatch,
                                result: list[RowGroupOutput]) -> None:
        """A chunk of PROMPT_LOGPROBS_CHUNK prompt rows at a time: a 2,048-token chunk's float32 log-softmax
        over a 49k vocabulary would take 400 MB at once (and its logits as much again)."""
        rows = sb.prompt_rows
        for lo in range(0, len(rows), PROMPT_LOGPROBS_CHUNK):
            part = rows[lo:lo + PROMPT_LOGPROBS_CHUNK]
            lp = prompt_logits(slice(lo, lo + len(part))).float().log_softmax(-1)  # (chunk, V)
            toks = gather_logprobs(lp, [r.token_id for r in part], [r.num_logprobs for r in part])
            for r, tok in zip(part, toks):
                result[r.entry].prompt_logprobs.append(PromptLogprob(r.position, tok))

    def _linear_attn_metadata(self, out: SchedulerOutput) -> LinearAttnMetadata:
        pool, dev = self.state_pool, self.device
        seqs = [s.seq for s in out.scheduled]
        return LinearAttnMetadata(
            state_slots=torch.tensor([pool.read_slot(s) for s in seqs], dtype=torch.int64, device=dev),
            has_initial_state=torch.tensor([s.start > 0 for s in out.scheduled], device=dev),
            conv_pools=pool.conv_pools, recurrent_pools=pool.recurrent_pools,
            write_slots=torch.tensor([pool.write_slot(s) for s in seqs], dtype=torch.int64, device=dev))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write for forked sequences: block dst gets block src's K/V in every layer."""
        if pairs:
            if self.executor is not None:  # every rank holds its own heads of these blocks
                with self.executor.run(CopyBlocks(pairs)):
                    pass
            src = torch.tensor([p[0] for p in pairs], device=self.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # (L, 2, n, bs, Hkv, D)

    def written_blocks(self, out: SchedulerOutput) -> set[int]:
        """Blocks a (possibly failed) step may have written K/V into."""
        bs = self.block_size
        return {b for s in out.scheduled
                for b in s.seq.block_table[s.start // bs:(s.start + s.num_new_tokens - 1) // bs + 1]}

    def warmup(self, num_tokens: int = 8) -> None:
        """Choose the CPU kernels by timing them here (`measure_cpu_kernels`; logged at INFO, and printed
        by `minivllm bench`), then one small prefill through the whole stack (writes only free,
        uncached blocks), so lazy initialisation happens before the first request is timed; a compiled
        model runs one prefill of each compiled size."""
        for line in self.measure_cpu_kernels():
            logging.getLogger("minivllm").info("%s", line)
        # A compiled model: one step of each compiled size, so that every graph is made
        # now rather than in the middle of the first requests.
        for n in self.compile_sizes or (num_tokens,):
            self.execute_model(SchedulerOutput(self._warmup_batch(min(n, self.num_blocks * self.block_size))))

    def measure_cpu_kernels(self) -> list[str]:
        """On this machine, time the matmul forms (layers/matmul_plan.py), RMSNorm's and RoPE's two ways
        (layers/norm_rope_kernels.py), decode attention's (layers/torch_attention.py) and greedy
        sampling's (layers/sampler.py), keep the faster, and say what was chosen. Idempotent for the
        matmuls; a GPU, or a model, backend or sampler without the choice, keeps its defaults."""
        said = []
        if hasattr(self.model, "plan_matmuls"):
            said.append(self.model.plan_matmuls().summary())
        if self.device.type == "cpu" and hasattr(self.model, "choose_norm_rope_kernels"):
            said.append(str(self.model.choose_norm_rope_kernels()))
        if self.device.type == "cpu" and hasattr(self.backend, "choose_decode_kernel"):
            said.append(str(self.backend.choose_decode_kernel(self.kv_cache.dtype, self.block_size)))
        if self.device.type == "cpu" and isinstance(self.sampler, Sampler):
            said.append(str(self.sampler.choose_greedy_kernel(self.spec.vocab_size, self.kv_cache.dtype)))
        return said

    def _warmup_batch(self, n: int) -> list[ScheduledSequence]:
        """Prompts of n tokens in all, none longer than the model's positions (a compiled size may be
        larger than one sequence can be: its RoPE table would be read out of bounds), on distinct
        free blocks."""
        bs, cap = self.block_size, self.spec.max_position_embeddings
        batch, first_block = [], 0
        while n > 0 and first_block < self.num_blocks:
            length = min(n, cap, (self.num_blocks - first_block) * bs)
            seq = Sequence(f"warmup-{len(batch)}", [0] * length, SamplingParams(temperature=1.0, top_p=0.9))
            seq.block_table = list(range(first_block, first_block + -(-length // bs)))
            if self.state_pool is not None:
                seq.state_slots = [0]  # reads nothing (start 0), writes a staging slot that is never published
            batch.append(ScheduledSequence(seq, 0, length))
            first_block, n = first_block + len(seq.block_table), n - length
            if self.state_pool is not None:
                break  # one staging slot: one sequence (hybrid models are not compiled anyway)
        return batch


def _rows_logits(model: torch.nn.Module, hidden: torch.Tensor, rows: slice) -> torch.Tensor:
    return model.compute_logits(hidden[rows])  # (rows, V)
