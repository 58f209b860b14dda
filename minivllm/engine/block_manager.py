"""`BlockManager`: the paged KV cache's bookkeeping — a fixed pool of blocks, reference counts and a
prefix cache. It never touches a tensor; it only decides which physical block holds which tokens.

    sequence tokens   [t0 .. t15][t16 .. t31][t32 t33 _ _ ...]
    block_table        [   7    ][    2     ][      9       ]     logical block i -> physical block
    KV pool            block 0 | 1 | 2 | ... | 7 | 8 | 9 | ...     (ModelRunner owns the tensors)

Invariants (proved by `check_invariants()`):
  * every block is either FREE (ref count 0, in `free_blocks`) or OWNED (ref count = number of block
    tables that hold it), never both;
  * a block's hash is registered only once the block is full and its K/V are computed.

Prefix caching. A full block's hash covers its tokens *and its parent's hash*:
    h_0 = hash((None, tokens[0:B]))      h_i = hash((h_{i-1}, tokens[i*B:(i+1)*B]))
so equal hashes mean equal whole prefixes, and one dictionary lookup per block finds the longest
cached prefix. A freed block keeps its hash and stays findable until it is reused: `free_blocks` is
an LRU queue (an OrderedDict, oldest first), and taking a block from it evicts its hash. A hit on a
free cached block simply takes it out of the queue again.

At least one prompt token is always computed (at most `(num_tokens - 1) // B` blocks can hit), so
the last prompt position produces the logits to sample from.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from minivllm.engine.sequence import Sequence


class PrefixMatch(NamedTuple):
    """The cached prefix found for a sequence: its blocks and how many tokens they hold."""

    blocks: list[int]
    num_tokens: int


class _Snapshot(NamedTuple):
    ref_counts: list[int]
    free_stamp: list[int]
    clock: int
    block_hash: list[int | None]
    hash_to_block: dict[int, int]
    stats: tuple[int, int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # When each block last joined the free queue: the queue is always in stamp order, so a
        # snapshot copies this list instead of the (10x slower to copy) OrderedDict.
        self.free_stamp: list[int] = list(range(num_blocks))
        self._clock = num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks  # hash of a full, computed block
        self.hash_to_block: dict[int, int] = {}  # the findable copy of each cached prefix block
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of which found cached

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of `seq`'s first `num_blocks` full blocks. Tokens are append-only, so
        they are computed once per block and kept on the sequence (even across preemption)."""
        hashes, B = seq.block_hashes, self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash((parent, seq.token_ids[i * B:(i + 1) * B].tobytes()))
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> PrefixMatch:
        """Longest cached prefix of `seq` (read-only: nothing is reserved until `allocate`)."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], 0)
        blocks: list[int] = []
        for h in self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size):  # leave >= 1 token
            block = self.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        return PrefixMatch(blocks, len(blocks) * self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch) -> bool:
        """Can `seq` be admitted with its cached prefix plus `num_new_tokens` computed now?"""
        needed = self.blocks_needed(prefix.num_tokens + num_new_tokens) - len(prefix.blocks)
        revived = sum(1 for b in prefix.blocks if self.ref_counts[b] == 0)  # leave the free queue
        return needed <= self.num_free_blocks - revived

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    # --- state changes -------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch) -> None:
        """Admit `seq`: share its cached prefix blocks and take fresh ones for `num_new_tokens`."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        for b in prefix.blocks:
            if self.ref_counts[b] == 0:
                del self.free_blocks[b]  # a hit on a freed-but-cached block revives it
            self.ref_counts[b] += 1
        seq.block_table = list(prefix.blocks)
        seq.num_computed_tokens = prefix.num_tokens
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += prefix.num_tokens
        self.append_slots(seq, num_new_tokens)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to cover `num_computed_tokens + num_new_tokens` (vLLM's may_append).
        A new block is needed exactly when the tokens run past the last block's end."""
        for _ in range(self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks. Tail blocks are queued first so that, under LRU, a prefix's
        later blocks are evicted before its earlier ones (an earlier block is useful more often)."""
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0:
                self.free_blocks[b] = None
                self.free_stamp[b] = self._clock
                self._clock += 1
        seq.block_table = []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After a step: register the hashes of blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        # Walk back to the last block already hashed: only blocks that filled since then need work.
        start = num_full
        while start > 0 and self.block_hash[seq.block_table[start - 1]] is None:
            start -= 1
        hashes = self.block_hashes(seq, num_full)
        for i in range(start, num_full):
            b = seq.block_table[i]
            self.block_hash[b] = hashes[i]
            # Two requests may compute the same block at once; the first stays the findable copy.
            self.hash_to_block.setdefault(hashes[i], b)

    def _take_free_block(self) -> int:
        b, _ = self.free_blocks.popitem(last=False)  # least recently freed
        h = self.block_hash[b]
        if h is not None:  # evict: its old content is about to be overwritten
            if self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
            self.block_hash[b] = None
        self.ref_counts[b] = 1
        return b

    # --- transactions --------------------------------------------------------------------------
    def snapshot(self) -> _Snapshot:
        return _Snapshot(list(self.ref_counts), list(self.free_stamp), self._clock, list(self.block_hash),
                         dict(self.hash_to_block), (self.num_queried_tokens, self.num_hit_tokens))

    def restore(self, snap: _Snapshot, written_blocks: set[int] = frozenset()) -> None:
        """Roll back to `snap`. Blocks in `written_blocks` may hold partial K/V of the failed step;
        if one of them was a free cached block, its hash is dropped so it can never be served."""
        self.ref_counts = list(snap.ref_counts)
        self.free_stamp, self._clock = list(snap.free_stamp), snap.clock
        free = [b for b in range(self.num_blocks) if self.ref_counts[b] == 0]
        self.free_blocks = OrderedDict.fromkeys(sorted(free, key=self.free_stamp.__getitem__))
        self.block_hash = list(snap.block_hash)
        self.hash_to_block = dict(snap.hash_to_block)
        self.num_queried_tokens, self.num_hit_tokens = snap.stats
        for b in written_blocks:
            h = self.block_hash[b]
            if h is not None and self.ref_counts[b] == 0:
                self.block_hash[b] = None
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]

    # --- proof ---------------------------------------------------------------------------------
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Assert the ownership invariants against the block tables of all live sequences."""
        owners = [0] * self.num_blocks
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"duplicate block in {seq}"
            for b in seq.block_table:
                owners[b] += 1
        for b in range(self.num_blocks):
            is_free = b in self.free_blocks
            assert self.ref_counts[b] == owners[b], f"block {b}: ref {self.ref_counts[b]} != owners {owners[b]}"
            assert is_free == (owners[b] == 0), f"block {b}: free={is_free} but owned by {owners[b]}"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"block {b} is findable under a hash it does not hold"
        assert self.num_hit_tokens <= self.num_queried_tokens
