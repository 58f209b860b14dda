"""`BlockManager`: the paged KV cache's bookkeeping — a fixed pool of blocks, reference counts and a
prefix cache. It never touches a tensor; it only decides which physical block holds which tokens.

    sequence tokens   [t0 .. t15][t16 .. t31][t32 t33 _ _ ...]
    block_table        [   7    ][    2     ][      9       ]     logical block i -> physical block
    KV pool            block 0 | 1 | 2 | ... | 7 | 8 | 9 | ...     (ModelRunner owns the tensors)

Invariants (proved by `check_invariants()`):
  * every block is either FREE (ref count 0, in `free_blocks`) or OWNED (ref count = number of block
    tables that hold it), never both — whatever the allocator;
  * a block's hash is registered only once the block is full and its K/V are computed, or are being
    computed by the step that allocated it (caching at allocation, below).

Prefix caching. A full block's hash covers its tokens *and its parent's hash*:
    h_0 = SHA-256(tokens[0:B])      h_i = SHA-256(h_{i-1} || tokens[i*B:(i+1)*B])
so equal hashes mean equal whole prefixes, and one dictionary lookup per block finds the longest
cached prefix. The hash must be collision-resistant: a collision would serve one prompt another
prompt's K/V (vLLM moved from Python's 64-bit `hash()` to SHA-256 after a cache-poisoning report;
anyone who can send prompts could search for `hash()` collisions). SHA-256 of 64 bytes costs ~1 us.

A freed block keeps its hash and stays findable until it is reused. Which free block is reused next
is the allocator's choice, `free_blocks` (engine/core/block_allocator.py: LRU by default, or yours): taking
a block from it evicts its hash, and a hit on a free cached block revives it (takes it out again).

At least one prompt token is always computed (at most `(num_tokens - 1) // B` blocks can hit), so
the last prompt position produces the logits to sample from.

Caching at allocation (vLLM v1's `cache_blocks`): `allocate` and `append_slots` register the hashes of
the blocks the step will fill, not the commit. A request admitted later in the same step (the next
sequence of an n > 1 request, a repeated prompt) then hits them: every attention layer writes the whole
batch's K/V into the cache before any of its rows read it, so the sharer reads what the owner writes in
the same forward. Only tokens count, never drafts: a draft's block is cached once the draft is verified
and the next step allocates past it. A failed step's registrations are undone with the rest of it.

Transactions (engine/request/journal.py). A step that fails is undone, yet nothing here records anything: the
per-block lists and the prefix-cache map are journaled containers and the manager a `Journaled` object, so
while the scheduler has a step open each write notes what it replaced, and a rollback costs what the step
touched, not the size of the pool. The allocator is wrapped the same way (`JournaledAllocator`).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, NamedTuple

from minivllm.engine.core.block_allocator import BlockAllocator, JournaledAllocator, get_allocator
from minivllm.engine.request.journal import Journaled, JournaledDict, JournaledList
from minivllm.engine.request.sequence import Sequence

if TYPE_CHECKING:
    from minivllm.engine.core.state_cache import StateCache


def hash_block(parent: bytes | None, token_bytes: bytes) -> bytes:
    """The prefix-cache key of a full block: SHA-256 over (parent's key, this block's token bytes)."""
    return hashlib.sha256((parent or b"") + token_bytes).digest()


# A table entry that holds no block: a sliding-window group's blocks that left the window
# (engine/core/sliding_window.py). Never in a full-attention table.
NULL_BLOCK = -1


class PrefixMatch(NamedTuple):
    """The cached prefix found for a sequence: its blocks and how many tokens they hold."""

    blocks: list[int]
    num_tokens: int


class PoolShortfall(NamedTuple):
    """A request bigger than a pool: the blocks it would need, and how many the pool has."""

    needed: int
    available: int


class BlockManager(Journaled):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 allocator: BlockAllocator | None = None, state_cache: StateCache | None = None) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = JournaledList([0] * num_blocks)
        # The allocator (None: LRU; yours is checked), in the wrapper that lets a rollback undo its calls.
        self.free_blocks = JournaledAllocator(get_allocator(allocator))
        self.free_blocks.reset(num_blocks)
        self._clock = num_blocks  # stamps each freed block: the allocator's order (LRU: oldest first)
        self.block_hash: list[bytes | None] = JournaledList([None] * num_blocks)  # hash of a full, computed block
        self.hash_to_block: dict[bytes, int] = JournaledDict()  # the findable copy of each cached prefix block
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of which found cached
        self.state_cache = state_cache  # a hybrid model's snapshot books: a hit needs a state snapshot too

    # --- which table of a sequence this manager keeps (a KV-cache group's: engine/core/kv_cache_groups.py) ---
    def table(self, seq: Sequence) -> list[int]:
        """The block table this manager owns on `seq` (the full-attention group's: `seq.block_table`)."""
        return seq.block_table

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks.stamps)  # its free blocks' stamps: a dict's len, asked per running request

    @property
    def kv_blocks_in_use(self) -> dict[str, int]:
        """Blocks held by a request, per KV-cache group (one group here; engine/core/kv_cache_groups.py)."""
        return {"full_attention": self.num_blocks - self.num_free_blocks}

    def pool_shortfall(self, num_tokens: int) -> PoolShortfall | None:
        """Whether one request of `num_tokens` computed tokens could never fit, even alone in the pool."""
        needed = self.blocks_needed(num_tokens)
        return PoolShortfall(needed, self.num_blocks) if needed > self.num_blocks else None

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of (at least) `seq`'s first `num_blocks` full blocks: the list kept on the
        sequence, which may hold more. Tokens are append-only, so they are computed once per block and kept
        on the sequence (even across preemption)."""
        hashes, B = seq.block_hashes, self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, seq.token_ids[i * B:(i + 1) * B].tobytes())
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> PrefixMatch:
        """Longest cached prefix of `seq` (read-only: nothing is reserved until `allocate`)."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return PrefixMatch([], 0)  # prompt logprobs need logits at every prompt position
        blocks: list[int] = []
        # Leave >= 1 token. The sequence may know more hashes than that (its last block, hashed when a
        # step that was then rolled back allocated it): never use them here.
        num_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(seq, num_blocks)[:num_blocks]
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        if self.state_cache is not None:  # back to the last position with a state snapshot
            blocks = blocks[:self.state_cache.hit_tokens(hashes, len(blocks) * self.block_size) // self.block_size]
        return PrefixMatch(blocks, len(blocks) * self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch) -> bool:
        """Can `seq` be admitted with its cached prefix plus `num_new_tokens` computed now?"""
        needed = self.blocks_needed(prefix.num_tokens + num_new_tokens) - len(prefix.blocks)
        revived = sum(1 for b in prefix.blocks if self.ref_counts[b] == 0)  # leave the free queue
        return needed <= self.num_free_blocks - revived

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(self.table(seq))
        return needed <= self.num_free_blocks

    # --- state changes -------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch) -> None:
        """Admit `seq`: share its cached prefix blocks and take fresh ones for `num_new_tokens`."""
        assert not self.table(seq), f"{seq.request_id} already holds blocks"
        for b in prefix.blocks:
            if b == NULL_BLOCK:  # before a sliding window: never read, not held
                continue
            if self.ref_counts[b] == 0:
                self.free_blocks.revive(b)  # a hit on a freed-but-cached block revives it
            self.ref_counts[b] += 1
        self.table(seq).extend(prefix.blocks)
        seq.num_computed_tokens = prefix.num_tokens
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += prefix.num_tokens
        self.append_slots(seq, num_new_tokens)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to cover `num_computed_tokens + num_new_tokens` (vLLM's may_append), then
        publish the blocks this step fills (caching at allocation; drafts excluded: `seq.num_tokens`
        counts tokens only). A new block is needed exactly when the tokens run past the last block's end."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(self.table(seq))
        for _ in range(needed):
            self.table(seq).append(self._take_free_block())
        self.cache_blocks(seq, min(seq.num_computed_tokens + num_new_tokens, seq.num_tokens))

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks. Tail blocks are queued first so that, under LRU, a prefix's
        later blocks are evicted before its earlier ones (an earlier block is useful more often)."""
        if self.table(seq):
            self._release(seq, 0)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """At the commit: free the blocks past those covering `num_tokens` tokens, the slots reserved for
        drafts that were rejected. They hold no hash (only tokens' blocks are ever published). (A
        sliding-window group also gives back here the blocks that left the window.)"""
        keep = self.blocks_needed(num_tokens)
        if len(self.table(seq)) > keep:
            self._release(seq, keep)

    def _release(self, seq: Sequence, keep: int) -> None:
        """Drop `seq`'s references to its blocks from index `keep` on, last block first."""
        table = self.table(seq)
        for b in reversed(table[keep:]):
            if b != NULL_BLOCK:  # (a sliding window's block that was already given back)
                self._unref(b)
        del table[keep:]

    def _unref(self, b: int) -> None:
        """One table lets go of block `b`; its last owner gives it back to the allocator, stamped now."""
        self.ref_counts[b] -= 1
        assert self.ref_counts[b] >= 0
        if self.ref_counts[b] == 0:
            self.free_blocks.give_back(b, self._clock)
            self._clock += 1

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the hashes of `seq`'s full blocks among its first `num_tokens` tokens (computed, or
        computed by this step: see "Caching at allocation")."""
        if not self.enable_prefix_caching:
            return
        table = self.table(seq)
        num_full = min(num_tokens // self.block_size, len(table))
        # Walk back to the last block already hashed: only blocks that filled since then need work.
        start = num_full
        while start > 0 and table[start - 1] != NULL_BLOCK and self.block_hash[table[start - 1]] is None:
            start -= 1
        hashes = self.block_hashes(seq, num_full)
        for i in range(start, num_full):
            b = table[i]
            if b == NULL_BLOCK:
                continue
            self.block_hash[b] = hashes[i]
            # Two requests may compute the same block at once; the first stays the findable copy.
            if hashes[i] not in self.hash_to_block:
                self.hash_to_block[hashes[i]] = b

    def _take_free_block(self) -> int:
        b = self.free_blocks.take()  # the allocator's choice (LRU: the least recently freed)
        self._forget_hash(b)  # evict: its old content is about to be overwritten
        self.ref_counts[b] = 1
        return b

    def _forget_hash(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            if self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
            self.block_hash[b] = None

    def forget_overwritten(self, blocks: set[int], sliding_blocks: set[int] = frozenset()) -> None:
        """After a failed step: blocks whose K/V it may have overwritten lose their hash if free, so they are
        never served from the prefix cache. (`sliding_blocks`: another group's, for the coordinator.)"""
        for b in blocks:
            if self.block_hash[b] is not None and self.ref_counts[b] == 0:
                self._forget_hash(b)

    # --- proof ---------------------------------------------------------------------------------
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Assert the ownership invariants against the block tables of all live sequences."""
        owners = [0] * self.num_blocks
        for seq in live_seqs:
            held = [b for b in self.table(seq) if b != NULL_BLOCK]
            assert len(set(held)) == len(held), f"duplicate block in {seq}"
            for b in held:
                owners[b] += 1
        free = list(self.free_blocks)
        assert len(free) == len(set(free)) == len(self.free_blocks), "the allocator lists a block twice, or miscounts"
        free_set = set(free)
        for b in range(self.num_blocks):
            is_free = b in free_set
            assert self.ref_counts[b] == owners[b], f"block {b}: ref {self.ref_counts[b]} != owners {owners[b]}"
            assert is_free == (owners[b] == 0), f"block {b}: free={is_free} but owned by {owners[b]}"
        self.free_blocks.check_invariants()  # the allocator's own (LRU: its queue in stamp order)
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"block {b} is findable under a hash it does not hold"
        assert self.num_hit_tokens <= self.num_queried_tokens
