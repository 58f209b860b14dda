"""`StepInputs`: everything one rank's forward needs, packed by `ModelRunner.prepare_inputs` on rank 0.

    input_ids, positions   (T,)     the new tokens of every scheduled row group, back to back
    attn_metadata                   where their K/V go and what each row attends to (layers/attention_interface.py)
    logits_indices         (S + P,) the hidden rows that get logits: the S sampled rows, then the P
                                    prompt rows whose logprobs were asked (engine/sampling_metadata.py)
    linear_attn            hybrid models: each row group's state slots and the states the step keeps,
                           as its plan's rows say (`StateRow`: engine/step_types.py, engine/state_pool.py)
    attn_metadata.sliding  models with sliding-window layers: their group's slots and tables
                                    (`sliding_metadata`, engine/kv_cache_groups.py)

The same object feeds rank 0's forward, every tensor-parallel worker's (sent over the command
channel: it pickles its tensors as numpy arrays, ~0.03 ms a step where torch's own pickling took
0.5 ms on 2 CPU cores) and the draft model's: there is one forward path, `ModelRunner.forward`.
It holds no request, text or sampling parameter: a worker never needs one.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from minivllm.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from minivllm.engine.step_types import ScheduledSequence


class LinearAttnSlots(NamedTuple):
    """Which state slots each row group of a hybrid model reads and writes (the pools stay on the rank),
    and which states after some of its rows the step keeps: a stride position of its prompt (prefix
    caching) or every draft row of a verification (speculative decoding). All from the plan's `StateRow`s."""

    state_slots: torch.Tensor  # (B,) int64: the published slot it reads
    has_initial_state: torch.Tensor  # (B,) bool: False where the request starts now (nothing to read)
    write_slots: torch.Tensor  # (B,) int64: the staging slot its new state goes to
    kept_offsets: tuple[tuple[int, ...], ...]  # per row group: the row counts after which a state is kept
    to_cache: torch.Tensor  # (K,) bool: kept state k goes to the state cache (else: a candidate slot)
    cache_slots: torch.Tensor  # (K1,) int64: the snapshot slots the plan took for them, in order
    candidate_slots: torch.Tensor  # (K2,) int64: the state pool's candidate slots, in order

    def to(self, device: torch.device) -> "LinearAttnSlots":
        return self._replace(**{name: getattr(self, name).to(device) for name in self._fields
                                if isinstance(getattr(self, name), torch.Tensor)})


def linear_attn_slots(scheduled: Sequence[ScheduledSequence], device: torch.device) -> LinearAttnSlots:
    """A hybrid step's slots, from its rows' `StateRow`s: each row group's read and staging slot, and where
    the states it keeps go — prompt snapshots (a prefill chunk) or candidates (a verification)."""
    rows = [s.state for s in scheduled]
    kept = [(slot, r.kept_are_snapshots) for r in rows for slot in r.kept_slots]
    return LinearAttnSlots(
        state_slots=torch.tensor([r.read_slot for r in rows], dtype=torch.int64, device=device),
        has_initial_state=torch.tensor([s.start > 0 for s in scheduled], device=device),
        write_slots=torch.tensor([r.write_slot for r in rows], dtype=torch.int64, device=device),
        kept_offsets=tuple(r.kept_offsets for r in rows),
        to_cache=torch.tensor([to_cache for _, to_cache in kept], dtype=torch.bool, device=device),
        cache_slots=torch.tensor([slot for slot, to_cache in kept if to_cache], dtype=torch.int64, device=device),
        candidate_slots=torch.tensor([slot for slot, to_cache in kept if not to_cache], dtype=torch.int64,
                                     device=device))


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (S + P,) int64
    num_sampled: int  # S: the first S of logits_indices are sampled; the rest are prompt rows
    linear_attn: LinearAttnSlots | None = None

    def __reduce__(self) -> tuple:
        assert self.linear_attn is None, "hybrid models run on one rank (models/sharding.py): no state slots are sent"
        m = self.attn_metadata
        assert m.sliding is None, "sliding-window models run on one rank (models/sharding.py)"
        tensors = (self.input_ids, self.positions, m.slot_mapping, m.cu_seqlens_q, m.context_lens, m.block_tables,
                   self.logits_indices)
        host = (m.query_lens, m.context_lens_host, m.block_size, self.num_sampled)
        return _unpickle, (tuple(t.cpu().numpy() for t in tensors), host)

    def to(self, device: torch.device) -> "StepInputs":
        """On `device` (a worker receives CPU tensors: a pickled CUDA tensor would come back on rank 0's GPU)."""
        here = self.input_ids.device
        if here.type == device.type and device.index in (None, here.index):  # "cuda" names cuda:0 too
            return self
        meta = _metadata_to(self.attn_metadata, device)
        slots = self.linear_attn.to(device) if self.linear_attn is not None else None
        return StepInputs(self.input_ids.to(device), self.positions.to(device), meta, self.logits_indices.to(device),
                          self.num_sampled, slots)


def sliding_metadata(scheduled: Sequence[ScheduledSequence], meta: AttentionMetadata, window: int,
                     device: torch.device) -> AttentionMetadata:
    """The step's rows for the sliding-window layers: their group's slots and block tables. A block that
    left the window (NULL_BLOCK, -1) reads as 0: the window keeps every backend from reading it."""
    bs, slots, flat = meta.block_size, array("q"), array("i")
    width = max(len(s.seq.sliding_block_table) for s in scheduled)
    for seq, start, n in ((s.seq, s.start, s.num_new_tokens) for s in scheduled):
        table = seq.sliding_block_table  # the rows' own positions always lie in blocks it holds
        slots.extend([table[p // bs] * bs + p % bs for p in range(start, start + n)])
        flat.extend([max(b, 0) for b in table])
        flat.extend([0] * (width - len(table)))
    return AttentionMetadata(
        slot_mapping=torch.frombuffer(slots, dtype=torch.int64).to(device), cu_seqlens_q=meta.cu_seqlens_q,
        context_lens=meta.context_lens,
        block_tables=torch.frombuffer(flat, dtype=torch.int32).view(len(scheduled), width).to(device),
        query_lens=meta.query_lens, context_lens_host=meta.context_lens_host, block_size=bs, sliding_window=window)


def _metadata_to(m: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """A copy of `m` (and of its sliding layers' metadata) with its tensors on `device`, without a plan."""
    values = {f.name: getattr(m, f.name) for f in fields(m) if f.name not in ("plan", "sliding")}
    return AttentionMetadata(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()},
                             sliding=_metadata_to(m.sliding, device) if m.sliding is not None else None)


def _unpickle(tensors: tuple[np.ndarray, ...], host: tuple) -> StepInputs:
    ids, positions, slots, cu, context_lens, tables, logits_indices = (torch.from_numpy(a) for a in tensors)
    query_lens, context_lens_host, block_size, num_sampled = host
    meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=cu, context_lens=context_lens, block_tables=tables,
                             query_lens=query_lens, context_lens_host=context_lens_host, block_size=block_size)
    return StepInputs(ids, positions, meta, logits_indices, num_sampled)
