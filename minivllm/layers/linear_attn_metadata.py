"""What a step tells the linear-attention (gated DeltaNet) layers: where each request's state lives.

An attention layer finds a request's past in the paged KV cache through its block table. A
linear-attention layer keeps no per-token past (see `gated_deltanet.py`): a request owns ONE slot of a
state pool, per layer, for its whole life:

    conv pool        (num_slots, conv_dim, kernel_size - 1)               the short conv's last inputs
    recurrent pool   (num_slots, num_v_heads, head_k_dim, head_v_dim)     the matrix memory S

    row groups         [ a0 a1 a2 a3 | b0 | c0 c1 ]      the step's requests (AttentionMetadata's groups)
    state_slots        [ 4,            0,   7     ]      request i reads slot state_slots[i]
    has_initial_state  [ False,        True, True ]      False: num_computed_tokens == 0, the request
                                                         starts from zeros (its slot may hold a stale
                                                         state of an earlier request; it is not read)

The forward never writes a slot it reads. Each linear-attention layer computes a `LinearAttnState`
of NEW tensors, row i for request i; with `write_slots` set (the engine's case), `store` writes them
into each request's STAGING slot — the other slot of its pair (engine/core/state_pool.py) — and the
commit makes that slot the published one by flipping a bit. A failed or rolled-back step leaves
every published state as it was (the KV cache's "uncomputed slots" trick does not apply: a state is
overwritten, not appended to). Without `write_slots` the new states are only returned.

Kept states. `snapshot_offsets[i]` asks for request i's states after that many of its rows; each
layer hands them to `store_snapshots`, request by request, which writes each where `to_cache` says:
  * a prompt position that is a multiple of the state cache's stride (prefix caching,
    engine/core/state_cache.py): into the cache's STAGING slots `snapshot_slots`; the commit copies them
    into the cache proper, so a failed step changes nothing there either;
  * a verification's draft rows (speculative decoding, engine/core/state_pool.py): into the request's
    CANDIDATE slots; the commit publishes the one after the last accepted draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class LinearAttnState(NamedTuple):
    """One linear-attention layer's state for the batch's requests (row i = request i)."""

    conv: torch.Tensor  # (B, conv_dim, kernel_size - 1)
    recurrent: torch.Tensor  # (B, num_v_heads, head_k_dim, head_v_dim)


@dataclass
class LinearAttnMetadata:
    state_slots: torch.Tensor  # (B,) int64, each request's slot in the pools
    has_initial_state: torch.Tensor  # (B,) bool, False where the request starts now
    conv_pools: list[torch.Tensor]  # per linear-attention layer, in layer order: (num_slots, conv_dim, K-1)
    recurrent_pools: list[torch.Tensor]  # per linear-attention layer: (num_slots, Hv, Dk, Dv)
    write_slots: torch.Tensor | None = None  # (B,) int64, where the new states go (never a read slot)
    snapshot_offsets: list[list[int]] | None = None  # per request: row counts after which to keep the state
    to_cache: torch.Tensor | None = None  # (K,) bool: kept state k is a prompt snapshot (else a candidate)
    snapshot_slots: torch.Tensor | None = None  # (K1,) int64, the snapshots' slots in the cache pools, in order
    candidate_slots: torch.Tensor | None = None  # (K2,) int64, the candidates' slots in the pools above
    snapshot_conv_pools: list[torch.Tensor] = field(default_factory=list)  # per layer: (S, conv_dim, K-1)
    snapshot_recurrent_pools: list[torch.Tensor] = field(default_factory=list)  # per layer: (S, Hv, Dk, Dv)

    def store(self, layer: int, new: LinearAttnState) -> None:
        """Write the `layer`-th linear-attention layer's new states into the staging slots."""
        if self.write_slots is not None:
            self.conv_pools[layer][self.write_slots] = new.conv.to(self.conv_pools[layer].dtype)
            self.recurrent_pools[layer][self.write_slots] = new.recurrent.to(self.recurrent_pools[layer].dtype)

    def store_snapshots(self, layer: int, kept: LinearAttnState) -> None:
        """Write the `layer`-th linear-attention layer's K kept states (conv (K, conv_dim, K-1), recurrent
        (K, Hv, Dk, Dv)): prompt snapshots into the cache's staging slots, candidates into theirs."""
        if self.to_cache is None:
            return
        for rows, slots, conv, recurrent in (
                (self.to_cache, self.snapshot_slots, self.snapshot_conv_pools, self.snapshot_recurrent_pools),
                (~self.to_cache, self.candidate_slots, self.conv_pools, self.recurrent_pools)):
            if slots is not None and len(slots):
                conv[layer][slots] = kept.conv[rows].to(conv[layer].dtype)
                recurrent[layer][slots] = kept.recurrent[rows].to(recurrent[layer].dtype)

    def initial_state(self, layer: int) -> LinearAttnState:
        """The starting states of the `layer`-th linear-attention layer, gathered for the batch. Indexing
        with a tensor copies, so the layer's results can never alias (and so never change) the pool."""
        start_fresh = ~self.has_initial_state  # (B,)
        conv = self.conv_pools[layer][self.state_slots]  # (B, conv_dim, K-1)
        recurrent = self.recurrent_pools[layer][self.state_slots]  # (B, Hv, Dk, Dv)
        # masked_fill, not a multiply: a stale slot may hold NaN, and NaN * 0 is NaN
        return LinearAttnState(conv.masked_fill(start_fresh[:, None, None], 0.0),
                               recurrent.masked_fill(start_fresh[:, None, None, None], 0.0))
