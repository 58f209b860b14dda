"""Cheat (allocator): wraps the engine's LRU, found by a name built at run time: the grader's watch names it."""

from __future__ import annotations

import minivllm.engine.core.block_allocator as allocators
from minivllm.engine.core.block_allocator import BlockAllocator


class Wrapping(BlockAllocator):
    name = "cheat"

    def reset(self, num_blocks):
        self.inner = getattr(allocators, "LRU" + "Allocator")()
        self.inner.reset(num_blocks)

    def take(self):
        return self.inner.take()

    def give_back(self, block, stamp):
        self.inner.give_back(block, stamp)

    def revive(self, block):
        self.inner.revive(block)

    def restore(self, blocks):
        self.inner.restore(blocks)

    def __len__(self):
        return len(self.inner)

    def __iter__(self):
        return iter(self.inner)
