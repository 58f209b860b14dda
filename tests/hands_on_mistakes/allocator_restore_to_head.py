"""Puts a rolled-back step's blocks at the head of the free list instead of back at their stamps' places.

A wrong solution from a student walkthrough (tests/test_hands_on_mistakes.py: WRONG)."""
from __future__ import annotations
from collections.abc import Iterator
from minivllm.engine.core.block_allocator import BlockAllocator


class MyAllocator(BlockAllocator):
    name = "my-lru"

    def __init__(self) -> None:
        self.stamps: dict[int, int] = {}

    def reset(self, num_blocks: int) -> None:
        self.stamps = {b: b for b in range(num_blocks)}

    def take(self) -> int:
        b = min(self.stamps, key=self.stamps.__getitem__)
        del self.stamps[b]
        return b

    def give_back(self, block: int, stamp: int) -> None:
        self.stamps[block] = stamp

    def revive(self, block: int) -> None:
        del self.stamps[block]

    def restore(self, blocks: list[tuple[int, int]]) -> None:
        # a rollback undoes takes, and takes come from the head: put them back in front
        low = min(self.stamps.values(), default=0)
        for i, (b, s) in enumerate(reversed(blocks)):
            self.stamps[b] = low - 1 - i

    def __len__(self) -> int:
        return len(self.stamps)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.stamps, key=self.stamps.__getitem__))
