"""`StepInputs`: everything one rank's forward needs, packed by `ModelRunner.prepare_inputs` on rank 0.

    input_ids, positions   (T,)     the new tokens of every scheduled row group, back to back
    attn_metadata                   where their K/V go and what each row attends to (layers/attention_interface.py)
    logits_indices         (S + P,) the hidden rows that get logits: the S sampled rows, then the P
                                    prompt rows whose logprobs were asked (engine/worker/sampling_metadata.py)
    linear_attn            hybrid models: each row group's state slots and the states the step keeps,
                           as its plan's rows say (`LinearAttnSlots`: engine/worker/hybrid_inputs.py)
    attn_metadata.sliding  models with sliding-window layers: their group's slots and tables
                                    (`sliding_metadata`: engine/worker/sliding_inputs.py)

The same object feeds rank 0's forward, every tensor-parallel worker's (sent over the command
channel: it pickles its tensors as numpy arrays, ~0.03 ms a step where torch's own pickling took
0.5 ms on 2 CPU cores) and the draft model's: there is one forward path, `ModelRunner.forward`.
It holds no request, text or sampling parameter: a worker never needs one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from minivllm.engine.worker.hybrid_inputs import LinearAttnSlots
from minivllm.layers.attention import AttentionMetadata


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
