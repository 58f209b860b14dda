"""Hands-on 4: the block manager's free list, whose order is the prefix cache's eviction order.

The block manager (minivllm/engine/core/block_manager.py) keeps ref counts, hashes and block tables; it asks
your allocator which free block to reuse. A freed block keeps its cached prefix until it is reused, so
choosing the block to take IS choosing which cached prefix to evict. Write LRU: the block freed longest
ago goes first, so a prefix used a moment ago outlives one unused for long.

The calls (each with a `stamp`, when the block was freed: a clock that only goes up):
  reset(n)                 blocks 0 .. n-1 free, block b freed at time b
  take()                   remove and return the least recently freed block
  give_back(block, stamp)  the block's last owner let go at `stamp`
  revive(block)            a prefix-cache hit takes this free block back (from anywhere in the order)
  restore(pairs)           a failed step is rolled back: these (block, stamp) pairs, oldest first, are
                           free again WITH THEIR OLD STAMPS (so each returns to its place)
  len(), iter()            how many are free; each free block once, the next to be taken first

Read `BlockAllocator` in minivllm/seams.py (the seam) and `LRUAllocator` in
minivllm/engine/core/block_allocator.py (the default), but write yours without copying the OrderedDict: a
dict of stamps and a `min` is a fine first version.

Grade:  python -m minivllm.teaching.grade_hands_on allocator exercises/hands_on/4_allocator/my_allocator.py
        (1: random call traces, call by call against the engine's LRU, then the scheduler's state machine
        with your allocator in the block manager: every block owned or free, ref counts, rollback, drain;
        2: the engine under memory pressure: HF-exact tokens and the LRU's prefix-cache hits)
Use:    LLM(model, block_allocator=MyAllocator())
"""

from __future__ import annotations

from collections.abc import Iterator

from minivllm.engine.core.block_allocator import BlockAllocator


class MyAllocator(BlockAllocator):
    name = "my-lru"

    def reset(self, num_blocks: int) -> None:
        """Every block free, block b freed at time b."""
        raise NotImplementedError

    def take(self) -> int:
        """Remove and return the least recently freed block."""
        raise NotImplementedError

    def give_back(self, block: int, stamp: int) -> None:
        """`block` is free again, freed at time `stamp`."""
        raise NotImplementedError

    def revive(self, block: int) -> None:
        """Remove `block` (free) from the free blocks: it is owned again."""
        raise NotImplementedError

    def restore(self, blocks: list[tuple[int, int]]) -> None:
        """A rollback: each (block, stamp) is free again with its old stamp."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        raise NotImplementedError
