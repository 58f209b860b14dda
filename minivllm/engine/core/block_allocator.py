"""The block allocators the engine ships, and the check it wraps an allocator of your own in.

A `BlockAllocator` decides which free block the `BlockManager` hands out next, so which cached prefix is
evicted: the seam for eviction policies. Its interface (reset, take, give_back, revive, len/iter, and
restore for a rollback) lives below the engine in minivllm/seams.py, with its contract, because the config
checks an allocator's type without importing the engine; it is imported here, so `from
minivllm.engine.core.block_allocator import BlockAllocator` works as before.

`LRUAllocator` is the default: the least recently freed block goes first (vLLM's order), so a prefix
used a moment ago outlives one unused for long. Write your own by subclassing `BlockAllocator`
(`LLM(model, block_allocator=MyAllocator())`); the engine wraps it in `CheckedAllocator`, which refuses
(`AllocatorContractError`, naming the rule) a `take()` of a block that is not free and a count that
disagrees with the blocks given and taken.

`JournaledAllocator` is how an allocator joins a step's transaction (engine/request/journal.py): the block manager
holds every allocator in one. It notes, per block, whether the block was free when the step began and with
which stamp; a rollback takes out the blocks free now that were not (`revive`) and gives back the others
in stamp order (`restore`), so any allocator, yours included, is undone through its own five calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from minivllm.engine.request.journal import JournaledContainer
from minivllm.seams import BlockAllocator

# BlockAllocator is re-exported: the path tests, exercises and notebooks import it by.
__all__ = ["AllocatorContractError", "BlockAllocator", "CheckedAllocator", "JournaledAllocator", "LRUAllocator",
           "get_allocator"]


class LRUAllocator(BlockAllocator):
    """The least recently freed block is reused first: an `OrderedDict` of block -> stamp, oldest first,
    always in stamp order, so taking is popping the head and freeing is appending at the tail."""

    name = "lru"

    def __init__(self) -> None:
        self.queue: OrderedDict[int, int] = OrderedDict()

    def reset(self, num_blocks: int) -> None:
        self.queue = OrderedDict((b, b) for b in range(num_blocks))

    def take(self) -> int:
        return self.queue.popitem(last=False)[0]

    def give_back(self, block: int, stamp: int) -> None:
        self.queue[block] = stamp  # the newest stamp: the tail

    def revive(self, block: int) -> None:
        del self.queue[block]  # a hit may take a block from the middle of the queue

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[int]:
        return iter(self.queue)

    def restore(self, blocks: list[tuple[int, int]]) -> None:
        """Blocks taken from the head go back to the head in O(len(blocks)); a block revived from the
        middle (a prefix-cache hit) needs the queue rebuilt in stamp order, which only a failed step pays."""
        if not blocks:
            return
        head = next(iter(self.queue.values()), None)
        if head is None or blocks[-1][1] < head:
            for block, stamp in reversed(blocks):
                self.queue[block] = stamp
                self.queue.move_to_end(block, last=False)
            return
        self.queue = OrderedDict(sorted([*self.queue.items(), *blocks], key=lambda item: item[1]))

    def check_invariants(self) -> None:
        stamps = list(self.queue.values())
        assert stamps == sorted(stamps), "the free queue is not in LRU (stamp) order"


class AllocatorContractError(AssertionError):
    """An allocator did something the block manager cannot use (the rule is in the message)."""


class CheckedAllocator(BlockAllocator):
    """Wraps an allocator and enforces the seam's contract on every call, naming the allocator and the rule
    it breaks: a block taken that is not free would be shared by two sequences (each overwriting the
    other's K/V); a count that is wrong would admit a request the pool cannot hold. It keeps its own set of
    the free blocks (O(1) a call). The engine wraps every allocator of your own in it (`get_allocator`)."""

    def __init__(self, inner: BlockAllocator) -> None:
        self.inner, self.name = inner, inner.name
        self.free: set[int] = set()

    def reset(self, num_blocks: int) -> None:
        self.inner.reset(num_blocks)
        self.free = set(range(num_blocks))
        self._counts("reset")

    def take(self) -> int:
        block = self.inner.take()
        if block not in self.free:
            raise AllocatorContractError(
                f"{type(self.inner).__name__} broke a RULE: take() must return a free block; got {block!r}, which "
                "is owned by a sequence or not a block of the pool (its K/V would be overwritten)")
        self.free.remove(block)
        self._counts("take")
        return block

    def give_back(self, block: int, stamp: int) -> None:
        self.inner.give_back(block, stamp)
        self.free.add(block)
        self._counts(f"give_back({block})")

    def revive(self, block: int) -> None:
        self.inner.revive(block)
        self.free.discard(block)
        self._counts(f"revive({block})")

    def restore(self, blocks: list[tuple[int, int]]) -> None:
        self.inner.restore(blocks)
        self.free.update(b for b, _ in blocks)
        self._counts("restore")

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        return iter(self.inner)

    def check_invariants(self) -> None:
        listed = list(self.inner)
        assert len(listed) == len(self.free) and set(listed) == self.free, (
            f"{type(self.inner).__name__} broke a RULE: iterating must give every free block once; "
            f"got {sorted(listed)[:12]}, free are {sorted(self.free)[:12]}")
        self.inner.check_invariants()

    def _counts(self, call: str) -> None:
        if len(self.inner) != len(self.free):
            raise AllocatorContractError(
                f"{type(self.inner).__name__} broke a RULE: len() must count the free blocks; after {call} it says "
                f"{len(self.inner)}, but {len(self.free)} are free")


def get_allocator(allocator: BlockAllocator | None) -> BlockAllocator:
    """The engine's allocator: LRU by default; one of your own, wrapped in `CheckedAllocator`."""
    if allocator is None:
        return LRUAllocator()
    if not isinstance(allocator, BlockAllocator):
        raise ValueError(f"block_allocator={allocator!r} is not a BlockAllocator: subclass "
                         "minivllm.seams.BlockAllocator, or pass None for LRU")
    return allocator if isinstance(allocator, CheckedAllocator) else CheckedAllocator(allocator)


class JournaledAllocator(JournaledContainer, BlockAllocator):
    """An allocator whose calls a step's rollback undoes (module docstring). It keeps each free block's
    stamp (when it was freed): what the allocator orders by, and what a rollback gives it back."""

    def __init__(self, inner: BlockAllocator) -> None:
        self.inner, self.name = inner, inner.name
        self.stamps: dict[int, int] = {}  # free block -> its stamp
        self._step: list | None = None  # the open step's notes this allocator has joined
        self._before: dict[int, int | None] = {}  # block -> its stamp when the step began (None: not free)

    def _note(self, block: int) -> None:
        notes = self._notes()
        if notes is None:
            return
        if self._step is not notes:  # the first call of this step: one note undoes all of them
            self._step, self._before = notes, {}
            notes.append((JournaledAllocator._undo, self, self._before))
        self._before.setdefault(block, self.stamps.get(block))

    def _undo(self, before: dict[int, int | None]) -> None:
        for block in before:
            if block in self.stamps:  # free now: out (back below if it was free then)
                del self.stamps[block]
                self.inner.revive(block)
        back = sorted(((b, stamp) for b, stamp in before.items() if stamp is not None), key=lambda item: item[1])
        self.inner.restore(back)  # oldest first
        self.stamps.update(back)

    def reset(self, num_blocks: int) -> None:
        self.inner.reset(num_blocks)
        self.stamps = {b: b for b in range(num_blocks)}

    def take(self) -> int:
        block = self.inner.take()
        self._note(block)
        del self.stamps[block]
        return block

    def give_back(self, block: int, stamp: int) -> None:
        self._note(block)
        self.inner.give_back(block, stamp)
        self.stamps[block] = stamp

    def revive(self, block: int) -> None:
        self._note(block)
        self.inner.revive(block)
        del self.stamps[block]

    def restore(self, blocks: list[tuple[int, int]]) -> None:
        raise NotImplementedError("a JournaledAllocator is restored by its journal's rollback")

    def __len__(self) -> int:
        return len(self.stamps)  # the free blocks (asked for every running request a step: no call down)

    def __iter__(self) -> Iterator[int]:
        return iter(self.inner)

    def check_invariants(self) -> None:
        assert set(self.stamps) == set(self.inner), "the stamps and the allocator disagree on what is free"
        self.inner.check_invariants()
