"""`UndoLog`: what one step changed in the scheduler and the block manager, so it can be undone.

A step is a transaction (see `LLMEngine.step`). The obvious way to undo one — copy every list of the
block manager before planning — costs as much as the pool is large: 262,144 blocks (what a small
model gets on a large GPU) made every step ~10x slower than 2,048. An undo log costs what the step
touches instead. Before a component changes something for the first time in a step it records the
old value here; a rollback writes those values back, a commit just drops the log.

    record_block(b)   a block's ref count, hash, free-queue stamp and whether it was free
    record_hash(h)    which block (or none) the prefix-cache map held under hash h
    record_seq(seq)   a sequence's status, computed tokens, block tables, cached tokens, skips, drafts,
                      state slots
    record_attr(o, n) any other field (queues, counters): its value, copied if it is a container

Only the FIRST record of each thing in a step is kept: that is the value to go back to.

`StepTransaction` opens a log for the scheduler, the block manager and the state pool together
(`begin`), and drops it (`commit`) or writes it back (`rollback`); the scheduler's `begin_step` /
`commit_step` / `rollback_step` are what the engine calls.

One thing a rollback cannot write back: K/V. A preemption frees its victim's blocks so that another
sequence can take them in the same step, and that step's forward writes the taker's K/V into them. If
the step then fails, giving the victim its blocks back would hand it (and the prefix cache, through
their hashes) someone else's K/V. So the log finds such victims before it is written back
(`UndoLog.reused`), and the scheduler preempts them again after the rollback (`Scheduler.rollback_step`):
they recompute, and the reused blocks, free again, lose their hashes. Every other change is undone exactly.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, NamedTuple

from minivllm.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch

    from minivllm.engine.kv_cache_groups import KVBlockManager
    from minivllm.engine.state_pool import StatePool


class BlockUndo(NamedTuple):
    ref_count: int
    block_hash: bytes | None
    free_stamp: int
    was_free: bool


class SeqUndo(NamedTuple):
    seq: Sequence
    status: SequenceStatus
    num_computed_tokens: int
    block_table: list[int]
    sliding_block_table: list[int]
    num_cached_tokens: int
    num_admission_skips: int
    spec_token_ids: list[int]
    draft_probs: torch.Tensor | None
    state_slots: list[int] | None


class Reused(NamedTuple):
    """Blocks that one sequence gave up in a step and another took (per KV-cache group), and the givers."""

    victims: list[Sequence]
    blocks: set[int]  # the full-attention group's
    sliding_blocks: set[int]  # a sliding-window group's


class AttrUndo(NamedTuple):
    obj: Any
    name: str
    value: Any


_MISSING = object()


class UndoLog:
    def __init__(self) -> None:
        self.blocks: dict[int, BlockUndo] = {}
        self.hashes: dict[bytes, int | None] = {}  # hash -> block it mapped to (None: absent)
        self.seqs: dict[int, SeqUndo] = {}  # keyed by id(seq)
        self.attrs: dict[tuple[int, str], AttrUndo] = {}

    def record_block(self, block: int, record: BlockUndo) -> None:
        self.blocks.setdefault(block, record)

    def has_block(self, block: int) -> bool:
        return block in self.blocks

    def record_hash(self, key: bytes, block: int | None) -> None:
        self.hashes.setdefault(key, block)

    def record_seq(self, seq: Sequence) -> None:
        if id(seq) not in self.seqs:
            self.seqs[id(seq)] = SeqUndo(seq, seq.status, seq.num_computed_tokens, list(seq.block_table),
                                         list(seq.sliding_block_table),
                                         seq.num_cached_tokens, seq.num_admission_skips, list(seq.spec_token_ids),
                                         seq.draft_probs,
                                         None if seq.state_slots is None else list(seq.state_slots))

    def record_attr(self, obj: Any, name: str) -> None:
        key = (id(obj), name)
        if key not in self.attrs:
            value = getattr(obj, name, _MISSING)
            self.attrs[key] = AttrUndo(obj, name, copy.copy(value))

    def undo_seqs_and_attrs(self) -> None:
        """Write back the sequences' fields and the recorded attributes (blocks: `BlockManager`)."""
        for s in self.seqs.values():
            seq = s.seq
            seq.status, seq.num_computed_tokens, seq.block_table = s.status, s.num_computed_tokens, s.block_table
            seq.sliding_block_table = s.sliding_block_table
            seq.num_cached_tokens, seq.num_admission_skips = s.num_cached_tokens, s.num_admission_skips
            seq.spec_token_ids, seq.draft_probs, seq.state_slots = s.spec_token_ids, s.draft_probs, s.state_slots
        for a in self.attrs.values():
            setattr(a.obj, a.name, a.value)

    def reused(self) -> Reused:
        """Before the sequences are written back: which of them gave up a block that another one took in
        this step (a block now in a table that did not hold it, gone from a table that did), per group."""
        victims: list[Sequence] = []
        per_group: list[set[int]] = []
        for now, then in ((lambda s: s.seq.block_table, lambda s: s.block_table),
                          (lambda s: s.seq.sliding_block_table, lambda s: s.sliding_block_table)):
            taken = {b for s in self.seqs.values() for b in set(now(s)) - set(then(s)) if b >= 0}  # -1: NULL_BLOCK
            group: set[int] = set()
            for s in self.seqs.values():
                lost = (set(then(s)) - set(now(s))) & taken
                if lost:
                    group |= lost
                    if all(v is not s.seq for v in victims):
                        victims.append(s.seq)
            per_group.append(group)
        return Reused(victims, *per_group)

    @property
    def size(self) -> int:
        """How many things the step touched (what a commit or rollback costs)."""
        return len(self.blocks) + len(self.hashes) + len(self.seqs) + len(self.attrs)


class StepTransaction:
    """The step's transaction over the scheduler's queues, the block manager and the state pool."""

    def __init__(self, owner: object, block_manager: KVBlockManager, state_pool: StatePool | None) -> None:
        self.owner = owner  # the scheduler: its queues and counters are recorded at `begin` (never written here)
        self.block_manager = block_manager
        self.state_pool = state_pool
        self.log: UndoLog | None = None  # the open step's log
        self.kept_preemptions: list[Sequence] = []  # the last rollback's victims (module docstring)

    def begin(self) -> None:
        """What changes from here on can be rolled back. The queues are copied (their size is the
        number of requests, never the size of the pool); blocks and sequences are recorded as they
        are touched."""
        assert self.log is None, "a transaction is already open"
        self.log = UndoLog()
        for name in ("running", "waiting", "num_preemptions"):
            self.log.record_attr(self.owner, name)
        self.block_manager.begin(self.log)
        if self.state_pool is not None:
            self.state_pool.begin(self.log)

    def commit(self) -> None:
        """The step succeeded: forget its log."""
        self.log = None
        self.block_manager.commit()
        if self.state_pool is not None:
            self.state_pool.end()

    def rollback(self, written_blocks: set[int] = frozenset()) -> Reused:
        """Undo everything since `begin()` (see `BlockManager.rollback` for `written_blocks`). Returns the
        preemptions whose blocks another sequence took (module docstring): the scheduler preempts those
        victims again, outside the transaction, and their reused blocks then lose their hashes."""
        assert self.log is not None, "no transaction is open"
        log, self.log = self.log, None
        reused = log.reused() if written_blocks else Reused([], set(), set())  # nothing ran: nothing written
        self.block_manager.rollback(written_blocks)  # also restores the sequences and the state pool's lists
        if self.state_pool is not None:
            self.state_pool.end()
        self.kept_preemptions = reused.victims
        return reused

    def record_seq(self, seq: Sequence) -> None:
        if self.log is not None:
            self.log.record_seq(seq)

    def record_attr(self, obj: object, name: str) -> None:
        if self.log is not None:
            self.log.record_attr(obj, name)
