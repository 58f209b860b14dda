"""What a model with sliding-window layers adds to its step's inputs: that group's slots and block tables.

Sliding-window layers keep their K/V in a pool of their own, with block tables of their own
(engine/core/kv_cache_groups.py, engine/core/sliding_window.py). Each step's rows are the same as the full
layers' (`cu_seqlens_q`, `context_lens`), but where their K/V go and which blocks they read differ:
`sliding_metadata` builds that second `AttentionMetadata`, which travels as `meta.sliding`. A model
without such layers never comes here (`ModelRunner.prepare_inputs` calls it at one line).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from minivllm.engine.request.step_types import ScheduledSequence
from minivllm.layers.attention import AttentionMetadata


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
