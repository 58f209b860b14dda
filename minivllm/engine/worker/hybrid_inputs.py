"""What a hybrid model's step adds to its inputs: the linear-attention layers' state slots.

    linear_attn_slots      packing (rank 0): each row group's read and staging slot, and where the states
                           it keeps go, from its plan's `StateRow` (engine/request/step_types.py,
                           engine/core/state_pool.py)
    linear_attn_metadata   the forward: those slots beside the runner's state tensors
                           (engine/worker/state_tensors.py), as the layers read them (layers/linear_attn_metadata.py)

A plain model's step never comes here: `StepInputs.linear_attn` is None, and `ModelRunner` calls these
at one line each, only when it holds `state_tensors`. Hybrid models run on one rank (models/sharding.py),
so these slots are never sent to a tensor-parallel worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from minivllm.engine.request.step_types import ScheduledSequence
from minivllm.engine.worker.state_tensors import StateTensors
from minivllm.layers.linear_attn_metadata import LinearAttnMetadata


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


def linear_attn_metadata(slots: LinearAttnSlots, st: StateTensors) -> LinearAttnMetadata:
    """The step's slots and the rank's state pools, as the linear-attention layers read them."""
    return LinearAttnMetadata(slots.state_slots, slots.has_initial_state, st.conv_pools, st.recurrent_pools,
                              slots.write_slots, [list(o) for o in slots.kept_offsets], slots.to_cache,
                              slots.cache_slots, slots.candidate_slots, st.snapshot_conv_pools,
                              st.snapshot_recurrent_pools)
