"""`StatePool`: the per-request state of a hybrid model's linear-attention layers, beside the KV pool.

An attention layer's memory of a request grows with it (the paged KV cache). A gated-DeltaNet layer's
does not: one convolution window and one recurrent matrix per request per layer, overwritten at
every step (layers/gated_deltanet.py). So a hybrid model needs two pools: blocks for its attention
layers, and a fixed number of STATE SLOTS for its linear-attention layers, one per running request
(ONNX Runtime GenAI's engine design calls it the request-state pool).

    running request  ->  block_table [7, 2, 9]     (full-attention layers: paged KV cache)
                     ->  state slot pair 3         (linear-attention layers: conv + recurrent state)

Transactions. A step must not change a request's state until it commits, yet a state is rewritten,
not appended to, and is ~1 MB per layer per request: copying it aside every step would cost more
than the step. So each request owns a PAIR of physical slots and a bit saying which holds its
published state. The forward reads the published slot and writes its new state into the other one
(out of place); the commit flips the bit. A failed step flips nothing: every published state is as
it was, and the retry reads it again. Allocating and freeing pairs (admission, finish, preemption)
goes through the step's undo log like the blocks.

    pair p = physical slots (2p, 2p + 1);  published = 2p + current[p];  staging = the other one

Speculative decoding. A verification step feeds a request's last token and d drafts, d + 1 rows; if
only a drafts are accepted, the state to publish is the one after 1 + a rows, not after all of them.
So each pair also has d CANDIDATE slots: the forward keeps the state after rows 1 .. d there, and the
commit copies the accepted one into the staging slot before flipping (`publish`). A rejected draft
costs one state copy; memory grows from 2 to 2 + d states per request.

    candidate slot of pair p after j rows (1 <= j <= d) = 2P + p*d + j - 1

Prefix caching (engine/state_cache.py): a request admitted with a cached prefix starts from the
snapshot at the prefix's end, copied into the published slot of its new pair at admission (the pair
was free: nobody reads that slot, and a rollback frees the pair again).
"""

from __future__ import annotations

import torch

from minivllm.engine.kv_cache import zeros
from minivllm.engine.sequence import Sequence
from minivllm.engine.state_cache import StateCache
from minivllm.engine.step_types import ScheduledSequence
from minivllm.engine.undo_log import UndoLog
from minivllm.models.hf_config import ModelSpec


class StatePool:
    def __init__(self, spec: ModelSpec, num_pairs: int, dtype: torch.dtype, device: torch.device,
                 cache: StateCache | None = None, num_speculative_tokens: int = 0) -> None:
        la = spec.linear_attn
        assert la is not None, "only hybrid models have linear-attention state"
        n = (2 + num_speculative_tokens) * num_pairs  # physical slots: the pairs, then the candidates
        # The conv window in the model's dtype; the recurrent state in fp32, like HF's (it accumulates).
        # On CPU the pools are committed page by page as states are written (see engine/kv_cache.py).
        self.conv_pools = [zeros((n, *la.conv_state_shape), dtype, device)
                           for _ in spec.linear_attention_layers]  # ((2 + d)P, conv_dim, K-1) each
        self.recurrent_pools = [zeros((n, *la.recurrent_state_shape), torch.float32, device)
                                for _ in spec.linear_attention_layers]  # ((2 + d)P, Hv, Dk, Dv) each
        self.num_pairs, self.num_speculative_tokens = num_pairs, num_speculative_tokens
        self.current = [0] * num_pairs  # which slot of each pair holds the published state
        self.free: list[int] = list(range(num_pairs - 1, -1, -1))  # a stack: pop() takes pair 0 first
        self.undo: UndoLog | None = None  # the scheduler's open transaction, if any
        self.cache = cache  # prefix caching's snapshots (None: prefix caching off)

    @property
    def num_free(self) -> int:
        return len(self.free)

    # --- ownership (inside the step's transaction) -----------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        return seq.state_slots is not None or len(self.free) >= 1

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` its pair (and, after a prefix hit, the cached state to start from)."""
        if seq.state_slots is not None:
            return
        self._record(seq)
        seq.state_slots = [self.free.pop()]
        if seq.num_computed_tokens:  # a prefix hit (the block manager checked a snapshot is there)
            self.cache.load(seq, self.conv_pools, self.recurrent_pools, self.read_slot(seq), self.undo)

    def release(self, seq: Sequence) -> None:
        if seq.state_slots is None:
            return
        self._record(seq)
        self.free.extend(reversed(seq.state_slots))
        seq.state_slots = None

    def _record(self, seq: Sequence) -> None:
        if self.undo is not None:
            self.undo.record_attr(self, "free")  # a list of at most max_num_seqs ints
            self.undo.record_seq(seq)

    # --- the step ----------------------------------------------------------------------------------
    def read_slot(self, seq: Sequence) -> int:
        pair = seq.state_slots[0]
        return 2 * pair + self.current[pair]

    def write_slot(self, seq: Sequence) -> int:
        pair = seq.state_slots[0]
        return 2 * pair + 1 - self.current[pair]

    def candidate_slot(self, seq: Sequence, num_rows: int) -> int:
        """Where a verification step keeps `seq`'s state after its first `num_rows` rows (1 .. d)."""
        return 2 * self.num_pairs + seq.state_slots[0] * self.num_speculative_tokens + num_rows - 1

    def publish(self, seq: Sequence, num_spec: int = 0, num_accepted: int = 0) -> None:
        """Commit: the state the step wrote into the staging slot becomes the published one. A verification
        step that accepted `num_accepted` of its `num_spec` drafts publishes its state after 1 + num_accepted
        rows instead, from that candidate slot."""
        if num_accepted < num_spec:
            src, dst = self.candidate_slot(seq, 1 + num_accepted), self.write_slot(seq)
            for pool in (*self.conv_pools, *self.recurrent_pools):
                pool[dst] = pool[src]
        pair = seq.state_slots[0]
        self.current[pair] ^= 1

    def publish_snapshots(self, scheduled: list[ScheduledSequence]) -> None:
        """Commit: the states the step kept at its stride positions join the prefix cache (if on)."""
        if self.cache is not None:
            self.cache.publish(scheduled)
