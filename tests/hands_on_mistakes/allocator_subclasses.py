"""Cheat (allocator): the engine's LRU under another name, as the base class."""

from __future__ import annotations

from minivllm.engine.core.block_allocator import LRUAllocator as Base


class Mine(Base):
    name = "cheat"
