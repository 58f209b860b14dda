"""Cheat (allocator): a star import brings in the engine's LRU, then wraps it."""

from __future__ import annotations

from minivllm.engine.core.block_allocator import *  # noqa: F403


class Wrapping(BlockAllocator):  # noqa: F405
    name = "cheat"

    def reset(self, num_blocks):
        self.inner = LRUAllocator()  # noqa: F405
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
