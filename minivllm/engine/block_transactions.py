"""`BlockTransactions`: the `BlockManager`'s side of a step's transaction — open, commit, roll back, and
the records every change makes first (see the block manager's docstring, "Transactions").

A change records the old value of what it touches, once per step: a block's ref count, hash,
free-queue stamp and whether it was free; a hash entry; a sequence (status, computed tokens, block
tables); an attribute (the clock, the hit counters). A rollback writes them back, so it costs what
the step touched, not the size of the pool. A mixin: the state it records is the `BlockManager`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.engine.sequence import Sequence
from minivllm.engine.undo_log import BlockUndo, UndoLog

if TYPE_CHECKING:
    from minivllm.engine.block_allocator import BlockAllocator


class BlockTransactions:
    # the BlockManager's state this side reads and restores
    undo: UndoLog | None
    ref_counts: list[int]
    block_hash: list[bytes | None]
    free_stamp: list[int]
    hash_to_block: dict[bytes, int]
    free_blocks: BlockAllocator
    # and `_forget_hash(block)`, the BlockManager's: a block's hash leaves the prefix cache

    def begin(self, undo: UndoLog) -> None:
        """Open a transaction: from now on every change is recorded in `undo`."""
        assert self.undo is None, "a transaction is already open"
        self.undo = undo

    def commit(self) -> None:
        self.undo = None

    def rollback(self, written_blocks: set[int] = frozenset()) -> None:
        """Undo the open transaction (the sequences' fields are restored by the `UndoLog`). Blocks in
        `written_blocks` may hold partial K/V of the failed step; if one of them was a free cached
        block, its hash is dropped so it can never be served."""
        undo, self.undo = self.undo, None
        assert undo is not None, "no transaction is open"
        for b, r in undo.blocks.items():
            if self.ref_counts[b] == 0:  # free now: out, and back below only if it was free before the step
                self.free_blocks.revive(b)
            self.ref_counts[b], self.block_hash[b], self.free_stamp[b] = r.ref_count, r.block_hash, r.free_stamp
        for h, b in undo.hashes.items():
            if b is None:
                self.hash_to_block.pop(h, None)
            else:
                self.hash_to_block[h] = b
        undo.undo_seqs_and_attrs()  # includes _clock and the hit counters
        was_free = [(b, r.free_stamp) for b, r in undo.blocks.items() if r.was_free]
        self.free_blocks.restore(sorted(was_free, key=lambda pair: pair[1]))  # oldest first
        self.forget_overwritten(written_blocks)

    def forget_overwritten(self, blocks: set[int], sliding_blocks: set[int] = frozenset()) -> None:
        """Blocks whose K/V a failed step may have overwritten: each one that is free loses its hash, so it is
        never served from the prefix cache. (`sliding_blocks`: another group's, for the coordinator.)"""
        for b in blocks:
            if self.block_hash[b] is not None and self.ref_counts[b] == 0:
                self._forget_hash(b)

    def _record_block(self, b: int) -> None:
        if self.undo is not None and not self.undo.has_block(b):
            # free exactly when no table holds it (the first invariant)
            self.undo.record_block(b, BlockUndo(self.ref_counts[b], self.block_hash[b], self.free_stamp[b],
                                                self.ref_counts[b] == 0))

    def _record_hash(self, h: bytes) -> None:
        if self.undo is not None:
            self.undo.record_hash(h, self.hash_to_block.get(h))

    def _record_seq(self, seq: Sequence) -> None:
        if self.undo is not None:
            self.undo.record_seq(seq)

    def _record_attrs(self, *names: str) -> None:
        if self.undo is not None:
            for name in names:
                self.undo.record_attr(self, name)
