"""`ModelRunner`: turns the scheduler's plan into tensors, runs the model, samples.

One step, three phases:
  1. `prepare_inputs`: pack every scheduled chunk into one flat varlen batch
       input_ids, positions           (T,)   the new tokens and their positions
       slot_mapping                   (T,)   where each new token's K/V is stored
       cu_seqlens_q, context_lens     (B+1,), (B,)
       block_tables                   (B, max_blocks)
       logits_indices                 (S,)   the rows whose logits are sampled: the last row of
                                             each chunk that reaches the end of its sequence
  2. forward: hidden states for all T rows, logits only for the S sampled rows (the LM head is the
     biggest matmul of a small model; a prefill chunk needs only its last row).
  3. sample: every row with its own parameters, in one call (`layers/sampler.py`).

It keeps no per-request state: everything comes from the `SchedulerOutput`, so a failed step
leaves nothing behind here (the K/V it wrote land in slots the engine treats as uncomputed).
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

import torch

from minivllm.engine.kv_cache import allocate_kv_cache
from minivllm.engine.scheduler import ScheduledSequence, SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.layers.attention import AttentionBackend, AttentionMetadata
from minivllm.layers.sampler import Sampler, SamplingTensors, TritonSampler
from minivllm.models.hf_config import ModelSpec
from minivllm.sampling_params import SamplingParams


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (S,)
    sampled_rows: list[int]  # which scheduled entries are sampled, in logits order
    sampling: SamplingTensors | None
    banned_token_ids: list[tuple[int, list[int]]]  # (logits row, ids) for min_tokens


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, backend: AttentionBackend, *, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model, self.spec, self.backend = model, spec, backend
        self.block_size, self.device = block_size, device
        self.eos_token_ids = eos_token_ids
        self.kv_cache = allocate_kv_cache(spec, num_blocks, block_size, dtype, device)
        self.kv_caches = list(self.kv_cache.unbind(0))  # per layer (2, num_blocks, bs, Hkv, D)
        self.sampler = TritonSampler() if backend.name == "triton" else Sampler()
        self.last_forward_s = 0.0  # time of the latest model forward + LM head (for overhead stats)

    # --- 1. pack ---------------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        input_ids, positions, seq_index = array("i"), array("q"), array("q")
        query_lens, context_lens, tables = [], [], []
        logits_indices, sampled_rows, sample_params, banned = [], [], [], []
        row = 0
        for i, (seq, start, n) in enumerate(out.scheduled):
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            seq_index.extend([i] * n)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(seq.block_table)
            row += n
            if start + n == seq.num_tokens:  # the chunk reaches the end: sample its last row
                sp = seq.sampling_params
                if seq.num_output_tokens < sp.min_tokens:
                    ids = list(sp.all_stop_token_ids) + ([] if sp.ignore_eos else list(self.eos_token_ids))
                    banned.append((len(logits_indices), ids))
                logits_indices.append(row - 1)
                sampled_rows.append(i)
                temperature = 0.0 if sp.greedy else sp.temperature
                sample_params.append((temperature, sp.top_k, sp.top_p, sp.min_p, seq.seed, seq.num_tokens))
        dev = self.device
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        positions_t = torch.frombuffer(positions, dtype=torch.int64)
        seq_index_t = torch.frombuffer(seq_index, dtype=torch.int64)
        # slot = physical block of the position's logical block * block_size + offset in the block
        slot_mapping = block_tables[seq_index_t, positions_t // bs].long() * bs + positions_t % bs
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev), cu_seqlens_q=cu.to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev), query_lens=query_lens, context_lens_host=context_lens,
            block_size=bs,
        )
        self.backend.prepare(meta)
        sampling = (SamplingTensors.from_params(sample_params, self.spec.vocab_size, dev)
                    if sample_params else None)
        return StepBatch(
            input_ids=torch.frombuffer(input_ids, dtype=torch.int32).long().to(dev),
            positions=positions_t.to(dev), attn_metadata=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            sampled_rows=sampled_rows, sampling=sampling, banned_token_ids=banned,
        )

    # --- 2 + 3. run and sample ------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> list[int | None]:
        """Run one step; returns the sampled token per scheduled entry (None: nothing sampled)."""
        batch = self.prepare_inputs(out)
        t0 = time.perf_counter()
        hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata, self.kv_caches,
                            self.backend)  # (T, hidden)
        result: list[int | None] = [None] * len(out.scheduled)
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # (S, V)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - t0
        if not batch.sampled_rows:
            return result
        for row, ids in batch.banned_token_ids:
            logits[row, ids] = float("-inf")
        tokens = self.sampler(logits, batch.sampling).tolist()
        for i, tok in zip(batch.sampled_rows, tokens):
            result[i] = tok
        return result

    def written_blocks(self, out: SchedulerOutput) -> set[int]:
        """Blocks a (possibly failed) step may have written K/V into."""
        bs = self.block_size
        return {b for s in out.scheduled
                for b in s.seq.block_table[s.start // bs:(s.start + s.num_new_tokens - 1) // bs + 1]}

    def warmup(self, num_tokens: int = 8) -> None:
        """One small prefill through the whole stack (writes only free, uncached blocks), so lazy
        initialisation happens before the first request is timed."""
        num_tokens = min(num_tokens, self.kv_cache.shape[2] * self.block_size)
        seq = Sequence("warmup", [0] * num_tokens, SamplingParams(temperature=1.0, top_p=0.9))
        seq.block_table = list(range(-(-num_tokens // self.block_size)))
        self.execute_model(SchedulerOutput([ScheduledSequence(seq, 0, num_tokens)]))
