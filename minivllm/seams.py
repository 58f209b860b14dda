"""The scheduler side's seams: the interfaces a policy of your own implements, kept below the engine.

Four `EngineConfig` fields take an object of your own (docs/concepts/seams.md). Each has an interface
and a default the engine ships; three wrap your object in a checker that enforces its contract on every
call (an attention backend's head counts are checked once, when the engine builds):

    field               interface           default, checker                 implemented in
    scheduling_policy   SchedulingPolicy    FCFSPolicy, CheckedPolicy        engine/core/scheduling_policy.py
    block_allocator     BlockAllocator      LRUAllocator, CheckedAllocator   engine/core/block_allocator.py
    attention_backend   AttentionBackend    "auto": by device                layers/attention_interface.py
    sampling_filter     SamplingFilter      TopKTopPMinP, CheckedFilter      layers/sampler.py

The first two interfaces are defined here; the last two live with their implementations in layers/.

Why a module of its own, below the engine. `EngineConfig` (minivllm/config.py) checks the type of what
it is given (`isinstance(value, BlockAllocator)`) and whether a policy's name is known, so it imports
each interface. The config is read by nearly every module, the engine's included: if the interfaces
lived in the engine, the config would import the engine that imports it. The two layer seams already
sit below (layers/ imports nothing of the engine); the scheduler's two sit here, and the engine imports
them down, as it imports the config. The implementations stay in engine/: this module imports nothing
of minivllm, not even for type hints, so a policy is typed against `SchedulableRequest`, a Protocol
naming what a policy may read of a request, which the engine's `Sequence` (engine/request/sequence.py) has.
The old import paths still work: engine/core/scheduling_policy.py and engine/core/block_allocator.py import the
interfaces from here.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from typing import Protocol, TypeVar


# --- the scheduling policy -------------------------------------------------------------------------


class SchedulableRequest(Protocol):
    """What a scheduling policy may read of a request: the engine passes its `Sequence`s (one per
    sample of a request), which have every attribute below and more (`status`, `sampling_params`)."""

    @property
    def request_id(self) -> str: ...
    @property
    def priority(self) -> int: ...  # lower = more urgent (vLLM's rule for "priority")
    @property
    def arrival_index(self) -> int: ...  # 0, 1, 2, ... in arrival order
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_admission_skips(self) -> int: ...  # times admission passed over it (the anti-starvation hold)


# A policy gets the engine's requests and gives back some of the same objects, never new ones.
RequestT = TypeVar("RequestT", bound=SchedulableRequest)


class SchedulingPolicy(abc.ABC):
    """The two choices a scheduler makes that are a matter of policy, not of mechanics:

        admission_order(waiting)    in which order to TRY to admit waiting requests this step
        choose_victim(candidates)   which running request to preempt when the pool is out of blocks

    Everything else stays in the `Scheduler` and holds for any policy: the token budget, chunked prefill,
    draft slots, state slots, skip-and-continue admission with its anti-starvation hold (it stops
    admission behind a starving request in the policy's order, never moves it forward: bounded waiting
    across priorities is the policy's job), and the rule that a victim is never a request already
    scheduled in this step (the candidates are the request that needs the block and the ones scheduled
    after it). A policy object lives as long as its engine, so it may keep state between steps; it is
    never told that a request finished (prune in `admission_order`, called every step that admits, with an
    empty waiting queue too: then it returns [])."""

    name = "custom"

    @abc.abstractmethod
    def admission_order(self, waiting: SequenceABC[RequestT]) -> list[RequestT]:
        """Every waiting request exactly once, most urgent first (the queue's order is arrival order,
        with preempted requests in front)."""

    @abc.abstractmethod
    def choose_victim(self, candidates: SequenceABC[RequestT]) -> RequestT:
        """One of `candidates` (running, in admission order; the last one was admitted last)."""


# The built-in policies' names, vLLM's (engine/core/scheduling_policy.py's POLICIES maps each to its class):
# the config refuses any other name without importing the engine.
POLICY_NAMES = ("fcfs", "priority")


def check_policy(policy: object) -> None:
    """Raise, naming the choices, unless `policy` is a built-in policy's name or a `SchedulingPolicy`."""
    if not isinstance(policy, SchedulingPolicy) and policy not in POLICY_NAMES:
        raise ValueError(f"scheduling_policy={policy!r}: use one of {sorted(POLICY_NAMES)} or a SchedulingPolicy")


# --- the block allocator ---------------------------------------------------------------------------


class BlockAllocator(abc.ABC):
    """Which free block the `BlockManager` hands out next: the seam for eviction policies.

    A free block may still hold a cached prefix (its hash stays findable until the block is reused), so
    choosing the block to reuse IS choosing which cached prefix to evict. The block manager keeps the
    mechanics (ref counts, hashes, block tables, the step's journal) and asks its allocator five things:

        reset(num_blocks)        every block 0 .. num_blocks-1 is free; block b was freed at time b
        take() -> block          remove and return the free block to reuse now (its cached prefix is evicted)
        give_back(block, stamp)  a block's last owner let go at time `stamp` (a clock that only goes up)
        revive(block)            remove this free block: a prefix-cache hit took it, or a rollback undoes a free
        len() / iter()           how many blocks are free; each of them once, the next to be taken first

    Rollback. A failed step is undone by the step's journal (engine/request/journal.py): the block manager holds
    its allocator in a `JournaledAllocator`, which keeps each free block's stamp. It calls `revive` for the blocks freed during the step, then `restore([(block, stamp), ...])` for the
    blocks that were free before it, oldest first. The default `restore` gives each back with its old
    stamp: exact for an allocator whose choice depends only on which blocks are free and their stamps
    (LRU, MRU, lowest id first, ...). One whose state has a history of its own (a random generator) must
    restore it too, or the rolled-back step will not replay the same choices.

    One instance serves one engine: `reset` is called when the engine's block manager is built."""

    name = "custom"

    @abc.abstractmethod
    def reset(self, num_blocks: int) -> None:
        """Every block of the pool free; block b counts as freed at time b (stamps 0 .. num_blocks-1)."""

    @abc.abstractmethod
    def take(self) -> int:
        """Remove and return one free block: the one to reuse now (raise if none is free: the block
        manager only asks when `len(self)` says one is)."""

    @abc.abstractmethod
    def give_back(self, block: int, stamp: int) -> None:
        """`block` is free again, freed at time `stamp` (later blocks get larger stamps)."""

    @abc.abstractmethod
    def revive(self, block: int) -> None:
        """Remove `block`, which is free, from the free blocks (it is owned again)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many blocks are free."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[int]:
        """Every free block once, the next to be taken first (traces and tests read it; need not be fast)."""

    def restore(self, blocks: list[tuple[int, int]]) -> None:
        """A rollback: these (block, stamp) pairs, free before the failed step, are free again with the
        stamps they had, oldest first."""
        for block, stamp in blocks:
            self.give_back(block, stamp)

    def check_invariants(self) -> None:
        """Your allocator's own invariants, asserted by `BlockManager.check_invariants` (none by default)."""
