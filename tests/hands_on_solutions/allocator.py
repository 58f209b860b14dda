"""Reference solution, hands-on 4: an LRU block allocator, the prefix cache's eviction order (graded by
`python -m minivllm.teaching.grade_hands_on allocator tests/hands_on_solutions/allocator.py`).

Kept out of the student's way; tests/test_hands_on.py grades it and plants mistakes in copies of it."""

from __future__ import annotations

from collections.abc import Iterator

from minivllm.engine.core.block_allocator import BlockAllocator


class LRUFreeList(BlockAllocator):
    """A dict of free block -> stamp (when it was freed); taking is finding the smallest stamp. O(free) a take:
    the engine's `LRUAllocator` keeps them in order instead (an OrderedDict), O(1)."""

    name = "hands-on-reference"

    def reset(self, num_blocks: int) -> None:
        self.stamps = {b: b for b in range(num_blocks)}

    def take(self) -> int:
        block = min(self.stamps, key=self.stamps.__getitem__)  # freed longest ago
        del self.stamps[block]
        return block

    def give_back(self, block: int, stamp: int) -> None:
        self.stamps[block] = stamp

    def revive(self, block: int) -> None:
        del self.stamps[block]  # a prefix-cache hit: owned again, wherever it was in the order

    def restore(self, blocks: list[tuple[int, int]]) -> None:
        self.stamps.update(blocks)  # the old stamps put each back in its place

    def __len__(self) -> int:
        return len(self.stamps)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.stamps, key=self.stamps.__getitem__))
