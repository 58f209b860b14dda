"""`SlidingWindowBlockManager`: the blocks of a sliding-window KV-cache group (Gemma 3's local layers).

A sliding-window layer with window W lets the query at position p see the keys at p - W + 1 .. p (W
keys, itself included: HF's `kv_idx > q_idx - sliding_window`). Once a request has computed c tokens,
its next query sits at c, so every block whose last position is below c - W + 1 will never be read
again by this request. This manager gives such blocks back and leaves `NULL_BLOCK` in the table, so
logical block i still means tokens [i*B, (i+1)*B) and slots are computed as for a full group:

    tokens          [t0..t3][t4..t7][t8..t11][t12..t15][t16 t17 _ _]     W = 8, B = 4, c = 18
    full group       [  7   ][  2   ][   9   ][   4    ][    11     ]     every block, for ever
    sliding group    [  -   ][  -   ][   3   ][   6    ][     1     ]     keys 11..18 are all it reads

Blocks are given back at each commit (`trim`), never while a step is planned: a block given
back inside the step's transaction could be taken and overwritten by another request in the same step,
and a rollback would then return it to its owner (and its hash to the prefix cache) with someone else's
K/V. After the commit nothing is rolled back.
Invariant (tested mid-decode): between steps, and so after `append_slots` for a decode, a request holds at most
ceil((W - 1) / B) + 1 <= ceil(W / B) + 1 blocks of this group, whatever its length. A prefill chunk of n
tokens holds the blocks of its own tokens too (its first query still reads W - 1 keys before it).

Everything else is the `BlockManager`'s, on the sequence's other table (`seq.sliding_block_table`):
ref counts, the allocator (its own pool: engine/core/kv_cache_groups.py says why), the journal. A block
given back keeps its hash, so it stays findable in the prefix cache until it is reused.

Prefix caching (vLLM's rule). A hit of h tokens is usable only if this group still has every block
that the query at h will read: blocks (h - W + 1) // B .. h // B - 1. Blocks before those need not
exist (they are NULL in the new table). `match_prefix` shortens the full group's hit until that holds:
if block m of the window is missing, no hit past m * B can use it, so the next try is h = m * B.

An n > 1 request's sequences share the prompt's full blocks through the prefix cache, like any
repeated prompt; each computes its partly filled last block itself, in both groups.
"""

from __future__ import annotations

from minivllm.engine.core.block_allocator import BlockAllocator
from minivllm.engine.core.block_manager import NULL_BLOCK, BlockManager, PrefixMatch
from minivllm.engine.request.sequence import Sequence


class SlidingWindowBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, sliding_window: int, enable_prefix_caching: bool = True,
                 allocator: BlockAllocator | None = None) -> None:
        assert sliding_window > 0
        super().__init__(num_blocks, block_size, enable_prefix_caching, allocator)
        self.sliding_window = sliding_window

    def table(self, seq: Sequence) -> list[int]:
        return seq.sliding_block_table

    def first_needed_block(self, position: int) -> int:
        """The first logical block the query at `position` reads: the one holding key position - W + 1."""
        return max(0, position - self.sliding_window + 1) // self.block_size

    @property
    def max_blocks_per_decode(self) -> int:
        """The most blocks one decoding request holds here: ceil((W - 1) / B) + 1."""
        return -(-(self.sliding_window - 1) // self.block_size) + 1

    # --- leaving the window ----------------------------------------------------------------------
    def _outside(self, seq: Sequence) -> range:
        """The logical blocks still held that no query from the last block boundary on will read. The
        boundary, not num_computed_tokens: a request that shares this prefix may start there (it recomputes
        the partial last block), so the window before the boundary stays findable while this request holds
        it; the bound on held blocks is the same either way. Blocks leave in order, so the held ones start after the last NULL: walking back from the window's
        first block stops at the first NULL, and the walk costs what is freed now."""
        boundary = seq.num_computed_tokens // self.block_size * self.block_size
        table = self.table(seq)
        end = min(self.first_needed_block(boundary), len(table))
        start = end
        while start > 0 and table[start - 1] != NULL_BLOCK:
            start -= 1
        return range(start, end)

    def free_outside_window(self, seq: Sequence) -> None:
        outside = self._outside(seq)
        table = self.table(seq)
        for i in outside:
            self._unref(table[i])
            table[i] = NULL_BLOCK

    # --- the BlockManager's calls, window-aware ------------------------------------------------------
    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """At the commit: the rejected drafts' slots, then what the next query will not read, go back (a
        block was published when it was allocated, so it keeps its hash when it goes). The bound on held
        blocks therefore holds between steps too."""
        super().trim(seq, num_tokens)
        self.free_outside_window(seq)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch) -> bool:
        held = [b for b in prefix.blocks if b != NULL_BLOCK]
        needed = self.blocks_needed(prefix.num_tokens + num_new_tokens) - len(prefix.blocks)
        revived = sum(1 for b in held if self.ref_counts[b] == 0)
        return needed <= self.num_free_blocks - revived

    def match_prefix(self, seq: Sequence, num_blocks: int) -> PrefixMatch:
        """This group's part of a prefix hit of (at most) `num_blocks` blocks found by the full group:
        the longest hit h <= num_blocks * B whose window blocks are all still cached here."""
        hashes = self.block_hashes(seq, num_blocks)
        k = num_blocks
        while k > 0:
            first = self.first_needed_block(k * self.block_size)
            missing = [i for i in range(first, k) if hashes[i] not in self.hash_to_block]
            if not missing:
                blocks = [NULL_BLOCK] * first + [self.hash_to_block[hashes[i]] for i in range(first, k)]
                return PrefixMatch(blocks, k * self.block_size)
            k = missing[-1]  # a hit past block m would read block m: try ending just before it
        return PrefixMatch([], 0)
