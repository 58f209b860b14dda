"""KV-cache groups (vLLM's hybrid allocator idea): layers that keep the same kind of memory form a group,
and each group gives a request its own block table.

    Gemma 3 (5 sliding : 1 full)     kind                 what a request holds there
    layers 0-4, 6-10, ...            sliding_attention    the blocks of its last W tokens: ~ceil(W/B) + 1
    layers 5, 11, ...                full_attention       every block of its context

A model whose layers are all full attention has one group: the plain `BlockManager`, untouched. A model
with sliding-window layers gets a `KVCacheCoordinator` in its place (vLLM's name): the scheduler calls
it exactly as it calls a `BlockManager`, and it answers for both groups: admission and appends fit only
if every group fits, preemption and finishing free every group, a prefix hit is what both groups hold.

One pool per kind, not one shared pool of equal pages. vLLM shares one pool: a page is a block of one
layer of each group, so groups must have equally many layers, and layers are regrouped to make it so
(Gemma 3 1B: one full group of 4 layers, several sliding groups of 4). Its win is that memory moves
between kinds as the load changes. Here each kind has its own tensors and its own `BlockManager`:
  * each group keeps the block manager as it is (ref counts, prefix cache, journal, allocator): the
    sliding group is a subclass that gives back blocks leaving the window (engine/core/sliding_window.py);
  * the sliding pool's need is bounded, so its size is a calculation, not a guess: max_num_seqs
    requests of ceil(W/B) + 2 blocks, plus a step's new tokens (`sliding_pool_blocks`, with the pools'
    sizing in engine/worker/kv_cache.py, the runner's side); what the full layers would have spent on those
    tokens' older blocks goes to the full pool instead;
  * the cost: memory is split at start-up. Under many short requests the sliding pool idles while
    the full pool fills (vLLM's shared pool would lend it). Admission still checks both pools, so a
    short pool only makes requests wait, never breaks one.
The hybrid's recurrent state stays in its own `StatePool` (engine/core/state_pool.py): a slot per request,
not blocks, so it is not a group here.

Prefix caching: a hit needs the full group's blocks up to the hit AND the sliding group's blocks of
the window before it (`SlidingWindowBlockManager.match_prefix`). The sliding blocks that leave the window
are given back with their hashes, so they stay findable until their pool reuses them: a repeat of a
recent prompt hits; one whose window blocks were reused recomputes from the last point that has them.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from minivllm.engine.core.block_manager import BlockManager, PoolShortfall, PrefixMatch
from minivllm.engine.core.sliding_window import SlidingWindowBlockManager
from minivllm.engine.request.journal import Journaled
from minivllm.engine.request.sequence import Sequence


class KVCacheKind(enum.StrEnum):
    """The kinds of KV memory a layer can keep (`EngineStats.kv_blocks_in_use`'s keys)."""

    FULL_ATTENTION = "full_attention"
    SLIDING_ATTENTION = "sliding_attention"


class GroupPrefixMatch(NamedTuple):
    """A prefix hit in every group: the same number of tokens, each group's own blocks."""

    full: PrefixMatch
    sliding: PrefixMatch

    @property
    def num_tokens(self) -> int:
        return self.full.num_tokens


class KVCacheCoordinator(Journaled):
    """The scheduler's block manager for a model with a full-attention and a sliding-window group."""

    def __init__(self, full: BlockManager, sliding: SlidingWindowBlockManager) -> None:
        assert full.block_size == sliding.block_size
        self.full, self.sliding = full, sliding
        self.groups: dict[KVCacheKind, BlockManager] = {KVCacheKind.FULL_ATTENTION: full,
                                                        KVCacheKind.SLIDING_ATTENTION: sliding}
        self.block_size = full.block_size
        self.enable_prefix_caching = full.enable_prefix_caching

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:  # every pool's blocks
        return sum(g.num_blocks for g in self.groups.values())

    @property
    def num_free_blocks(self) -> int:
        return sum(g.num_free_blocks for g in self.groups.values())

    @property
    def kv_blocks_in_use(self) -> dict[str, int]:
        return {str(kind): g.num_blocks - g.num_free_blocks for kind, g in self.groups.items()}

    @property
    def num_queried_tokens(self) -> int:  # prefix-cache counters: a hit is one hit, whatever the groups
        return self.full.num_queried_tokens

    @property
    def num_hit_tokens(self) -> int:
        return self.full.num_hit_tokens

    def blocks_needed(self, num_tokens: int) -> int:
        return self.full.blocks_needed(num_tokens)

    def pool_shortfall(self, num_tokens: int) -> PoolShortfall | None:
        """Only the full pool can be too small for one request (the sliding one holds a window)."""
        return self.full.pool_shortfall(num_tokens)

    def get_computed_blocks(self, seq: Sequence) -> GroupPrefixMatch:
        full = self.full.get_computed_blocks(seq)
        sliding = self.sliding.match_prefix(seq, len(full.blocks)) if full.blocks else full
        num_blocks = sliding.num_tokens // self.block_size
        return GroupPrefixMatch(PrefixMatch(full.blocks[:num_blocks], sliding.num_tokens), sliding)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: GroupPrefixMatch) -> bool:
        return (self.full.can_allocate(seq, num_new_tokens, prefix.full)
                and self.sliding.can_allocate(seq, num_new_tokens, prefix.sliding))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return all(g.can_append(seq, num_new_tokens) for g in self.groups.values())

    # --- state changes: every group -------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: GroupPrefixMatch) -> None:
        self.full.allocate(seq, num_new_tokens, prefix.full)
        self.sliding.allocate(seq, num_new_tokens, prefix.sliding)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        for g in self.groups.values():
            g.append_slots(seq, num_new_tokens)

    def free(self, seq: Sequence) -> None:
        for g in self.groups.values():
            g.free(seq)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        for g in self.groups.values():
            g.trim(seq, num_tokens)

    # --- after a failed step (engine/request/journal.py undoes the rest: both groups are under the step's journal) ---
    def forget_overwritten(self, blocks: set[int], sliding_blocks: set[int] = frozenset()) -> None:
        self.full.forget_overwritten(blocks)
        self.sliding.forget_overwritten(sliding_blocks)

    # --- proof ---------------------------------------------------------------------------------
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        for g in self.groups.values():
            g.check_invariants(live_seqs)
        for seq in live_seqs:  # both tables cover the same logical blocks (the sliding one has NULLs)
            assert len(seq.sliding_block_table) == len(seq.block_table), f"the groups' tables disagree: {seq}"


# What the scheduler holds: one group's `BlockManager`, or the coordinator of several.
KVBlockManager = BlockManager | KVCacheCoordinator
