"""`StatePool`: the books of a hybrid model's per-request linear-attention state, beside the KV blocks.

An attention layer's memory of a request grows with it (the paged KV cache). A gated-DeltaNet layer's
does not: one convolution window and one recurrent matrix per request per layer, overwritten at
every step (layers/gated_deltanet.py). So a hybrid model needs two pools: blocks for its attention
layers, and a fixed number of STATE SLOTS for its linear-attention layers, one per running request
(ONNX Runtime GenAI's engine design calls it the request-state pool).

    running request  ->  block_table [7, 2, 9]     (full-attention layers: paged KV cache)
                     ->  state slot pair 3         (linear-attention layers: conv + recurrent state)

This class is the scheduler's side of it: integers only (which pair a request holds, which slot of the pair
is published, which are free). The tensors are the runner's (engine/worker/state_tensors.py); every slot number
the runner needs travels in the plan, one `StateRow` per row group (engine/request/step_types.py), and the
layout both sides agree on is engine/request/state_layout.py.

Transactions. A step must not change a request's state until it commits, yet a state is rewritten,
not appended to, and is ~1 MB per layer per request: copying it aside every step would cost more
than the step. So each request owns a PAIR of physical slots and a bit saying which holds its
published state. The forward reads the published slot and writes its new state into the other one
(out of place); the commit flips the bit. A failed step flips nothing: every published state is as
it was, and the retry reads it again. Allocating and freeing pairs (admission, finish, preemption) is
undone with the blocks: the free list is a journaled container (engine/request/journal.py).

Speculative decoding. A verification step feeds a request's last token and d drafts, d + 1 rows; if
only a drafts are accepted, the state to publish is the one after 1 + a rows, not after all of them.
So each pair also has d CANDIDATE slots, where the forward keeps the state after rows 1 .. d; the runner,
which verifies the drafts, copies the accepted one into the staging slot before the step returns, and
the commit flips the bit as for any step. A rejected draft costs one state copy.

Prefix caching (engine/core/state_cache.py, its books): a request admitted with a cached prefix starts from
the snapshot at the prefix's end; its row says which snapshot slot the runner copies into the published
slot of its new pair before the forward (the pair was free: nobody reads that slot, and a rollback frees
the pair again). A prompt chunk that reaches a stride position keeps its state there, in a snapshot slot
its row names (a free one: a failed step leaves the cache as it was); the commit registers it.
"""

from __future__ import annotations

import dataclasses

from minivllm.engine.core.state_cache import StateCache
from minivllm.engine.request.journal import Journaled, JournaledList
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.state_layout import candidate_slot, pair_slots
from minivllm.engine.request.step_types import ScheduledSequence, StateRow


class StatePool(Journaled):
    def __init__(self, num_pairs: int, num_speculative_tokens: int = 0, cache: StateCache | None = None) -> None:
        self.num_pairs, self.num_speculative_tokens = num_pairs, num_speculative_tokens
        self.current = [0] * num_pairs  # which slot of each pair holds the published state
        self.free: list[int] = JournaledList(range(num_pairs - 1, -1, -1))  # a stack: pop() takes pair 0 first
        self.cache = cache  # prefix caching's snapshot books (None: prefix caching off)

    @property
    def num_free(self) -> int:
        return len(self.free)

    # --- ownership (inside the step's transaction) -----------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        return seq.state_slots is not None or len(self.free) >= 1

    def allocate(self, seq: Sequence) -> int | None:
        """Give `seq` its pair. After a prefix hit, the snapshot slot its state starts from (else None)."""
        if seq.state_slots is not None:
            return None
        seq.state_slots = [self.free.pop()]
        if seq.num_computed_tokens:  # a prefix hit (the block manager checked a snapshot is there)
            return self.cache.use(seq)
        return None

    def release(self, seq: Sequence) -> None:
        if seq.state_slots is None:
            return
        self.free.extend(reversed(seq.state_slots))
        seq.state_slots = None

    # --- the plan: each row group's slots ----------------------------------------------------------
    def read_slot(self, seq: Sequence) -> int:
        pair = seq.state_slots[0]
        return pair_slots(pair)[self.current[pair]]

    def write_slot(self, seq: Sequence) -> int:
        pair = seq.state_slots[0]
        return pair_slots(pair)[1 - self.current[pair]]

    def plan_rows(self, scheduled: list[ScheduledSequence], loads: dict[str, int]) -> list[ScheduledSequence]:
        """The step's rows with their state slots: read, write, the snapshot to load (`loads`, by request
        id: admitted with a prefix hit), and the states kept — a verification's candidates after rows
        1 .. d, or a prompt chunk's snapshots at stride positions (at most the cache's max_per_step a step)."""
        rows, budget = [], self.cache.cfg.max_per_step if self.cache is not None else 0
        if self.cache is not None:
            self.cache.reclaim()  # slots of a step whose commit failed before registering them
        for s in scheduled:
            seq = s.seq
            row = StateRow(self.read_slot(seq), self.write_slot(seq), loads.get(seq.request_id))
            if s.num_spec_tokens:
                offsets = tuple(range(1, s.num_new_tokens))
                slots = tuple(candidate_slot(self.num_pairs, self.num_speculative_tokens, seq.state_slots[0], j)
                              for j in offsets)
                row = row._replace(kept_offsets=offsets, kept_slots=slots, kept_are_snapshots=False)
            elif budget and self.cache is not None:
                positions = self.cache.positions(s.start, s.num_new_tokens, seq.num_prompt_tokens)[:budget]
                slots = self.cache.reserve(len(positions))  # free slots only: a failed step writes no entry's
                budget -= len(slots)
                row = row._replace(kept_offsets=tuple(p - s.start for p in positions[:len(slots)]),
                                   kept_slots=tuple(slots))
            rows.append(dataclasses.replace(s, state=row))
        return rows

    # --- the commit: integers only -------------------------------------------------------------------
    def publish(self, seq: Sequence) -> None:
        """The state the step wrote into the staging slot (after a verification: the accepted one, which the
        runner copied there) becomes the published one."""
        self.current[seq.state_slots[0]] ^= 1

    def publish_snapshots(self, scheduled: list[ScheduledSequence]) -> None:
        """The states the step kept at its stride positions join the prefix cache (if on)."""
        if self.cache is None:
            return
        for s in scheduled:
            if s.state is None or not s.state.kept_are_snapshots:
                continue
            hashes = s.seq.block_hashes
            for offset, slot in zip(s.state.kept_offsets, s.state.kept_slots):
                num_blocks = (s.start + offset) // self.cache.block_size
                self.cache.register(hashes[num_blocks - 1] if len(hashes) >= num_blocks else None, slot)
        self.cache.keep_free()
