"""The block allocator's seam: allocators of one's own under the scheduler's hypothesis machine (the block
manager's invariants after every action, an exact rollback, a full drain), the contract's rules named when
broken, and, through `LLM`, the same tokens whichever block holds the K/V."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.engine.core.block_allocator import AllocatorContractError, BlockAllocator, CheckedAllocator, LRUAllocator
from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.core.scheduling_policy import FCFSPolicy, PriorityPolicy
from minivllm.engine.request.journal import Journal
from minivllm.engine.request.sequence import Sequence
from minivllm.teaching.scheduler_machine import scheduler_machine


class PlainLRU(BlockAllocator):
    """LRU re-derived with a dict of stamps: take the block freed longest ago (O(n) a take)."""

    def reset(self, num_blocks: int) -> None:
        self.stamps = {b: b for b in range(num_blocks)}

    def take(self) -> int:
        block = min(self.stamps, key=self.stamps.__getitem__)
        del self.stamps[block]
        return block

    def give_back(self, block: int, stamp: int) -> None:
        self.stamps[block] = stamp

    def revive(self, block: int) -> None:
        del self.stamps[block]

    def __len__(self) -> int:
        return len(self.stamps)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.stamps, key=self.stamps.__getitem__))


class MostRecentFirst(PlainLRU):
    """The opposite eviction order (MRU): the block freed last is reused first."""

    def take(self) -> int:
        block = max(self.stamps, key=self.stamps.__getitem__)
        del self.stamps[block]
        return block

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.stamps, key=self.stamps.__getitem__, reverse=True))


class LowestFirst(BlockAllocator):
    """No stamps at all: the free block with the smallest id."""

    def reset(self, num_blocks: int) -> None:
        self.free = set(range(num_blocks))

    def take(self) -> int:
        block = min(self.free)
        self.free.remove(block)
        return block

    def give_back(self, block: int, stamp: int) -> None:
        self.free.add(block)

    def revive(self, block: int) -> None:
        self.free.remove(block)

    def __len__(self) -> int:
        return len(self.free)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.free))


# --- under the scheduler's machine: add, step, abort, failed step, drain -------------------------------
PlainLRUMachine = scheduler_machine(FCFSPolicy, make_allocator=PlainLRU)
PlainLRUMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPlainLRUMachine = PlainLRUMachine.TestCase
MRUMachine = scheduler_machine(PriorityPolicy, priorities=True, max_spec=2, make_allocator=MostRecentFirst)
MRUMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestMRUMachine = MRUMachine.TestCase
LowestFirstMachine = scheduler_machine(FCFSPolicy, make_allocator=LowestFirst)
LowestFirstMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestLowestFirstMachine = LowestFirstMachine.TestCase


# --- the block manager with an allocator of one's own -------------------------------------------------
def prefilled(bm: BlockManager, rid: str, tokens: list[int]) -> Sequence:
    s = Sequence(rid, tokens, SamplingParams())
    prefix = bm.get_computed_blocks(s)
    bm.allocate(s, s.num_tokens - prefix.num_tokens, prefix)
    s.num_computed_tokens = s.num_tokens
    bm.trim(s, s.num_tokens)  # the commit's part (caching: at allocation)
    return s


@pytest.mark.parametrize("make", [PlainLRU, MostRecentFirst, LowestFirst])
def test_a_rollback_puts_every_block_back_where_it_was(make):
    """A prefix hit revives free cached blocks, new blocks are taken, a request is freed: all undone exactly."""
    bm = BlockManager(num_blocks=10, block_size=4, allocator=make())
    for s in [prefilled(bm, name, list(range(start, start + 9))) for name, start in (("x", 100), ("a", 0), ("y", 200))]:
        bm.free(s)  # 9 of the 10 blocks free, a's 2 full ones cached, in the allocator's order
    keep = prefilled(bm, "k", list(range(300, 306)))
    before = (list(bm.free_blocks), list(bm.ref_counts), dict(bm.hash_to_block), dict(bm.free_blocks.stamps))
    journal = Journal()
    journal.watch(bm)
    journal.watch(keep)
    journal.begin()
    hit = Sequence("b", list(range(9)) + [50, 51, 52, 53], SamplingParams())
    prefix = bm.get_computed_blocks(hit)
    assert prefix.num_tokens == 8 and all(bm.ref_counts[b] == 0 for b in prefix.blocks)  # a's, free and cached
    bm.allocate(hit, hit.num_tokens - 8, prefix)  # revives them (from anywhere in the allocator), takes 2 more
    bm.free(keep)
    assert list(bm.free_blocks) != before[0]
    journal.rollback()
    assert (list(bm.free_blocks), list(bm.ref_counts), dict(bm.hash_to_block), dict(bm.free_blocks.stamps)) == before
    bm.check_invariants([keep])


class TakesAnOwnedBlock(LowestFirst):
    def take(self) -> int:
        self.free.discard(0)
        return 0  # block 0, free or not


class ForgetsToRevive(LowestFirst):
    def revive(self, block: int) -> None:
        pass  # the block stays listed free while a sequence holds it


class ListsABlockTwice(LowestFirst):
    def __iter__(self) -> Iterator[int]:
        return iter([*sorted(self.free), *sorted(self.free)[:1]])


def test_an_allocator_that_breaks_a_rule_is_named_with_the_rule():
    bm = BlockManager(num_blocks=4, block_size=2, allocator=TakesAnOwnedBlock())
    prefilled(bm, "a", [1, 2])  # takes block 0
    with pytest.raises(AllocatorContractError, match="TakesAnOwnedBlock broke a RULE: take\\(\\) must return a free"):
        prefilled(bm, "b", [3, 4])

    bm = BlockManager(num_blocks=4, block_size=2, allocator=ForgetsToRevive())
    bm.free(prefilled(bm, "a", [1, 2, 3]))  # block 0 full and cached, then free
    with pytest.raises(AllocatorContractError, match="ForgetsToRevive broke a RULE: len\\(\\) must count the free "
                                                     "blocks; after revive\\(0\\) it says 4, but 3 are free"):
        prefilled(bm, "b", [1, 2, 3])  # a prefix hit revives block 0

    bm = BlockManager(num_blocks=4, block_size=2, allocator=ListsABlockTwice())
    with pytest.raises(AssertionError, match="lists a block twice"):
        bm.check_invariants([])


def test_the_default_is_lru_and_yours_is_checked():
    assert isinstance(BlockManager(4, 2).free_blocks.inner, LRUAllocator)  # (in the journal's wrapper)
    mine = LowestFirst()
    checked = BlockManager(4, 2, allocator=mine).free_blocks.inner
    assert isinstance(checked, CheckedAllocator) and checked.inner is mine and len(mine) == 4
    with pytest.raises(ValueError, match="block_allocator='lru' is not a BlockAllocator"):
        EngineConfig(model="m", block_allocator="lru")


# --- through LLM: the same tokens whichever blocks hold the K/V ---------------------------------------
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7], [9] * 6, list(range(20, 37)), [5, 6, 7, 8, 9, 10])]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7 + i, max_tokens=10, ignore_eos=True)
           for i in range(len(PROMPTS))]


def tiny(model_factory, **kwargs) -> LLM:
    # 12 blocks of 4 for ~70 tokens: blocks are evicted and reused, requests preempted, prefixes hit
    return LLM(model_factory("qwen3"), warmup=False, block_size=4, num_kv_blocks=12, **kwargs)


def run(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_an_allocator_that_re_derives_lru_makes_the_same_choices(model_factory):
    lru, mine = tiny(model_factory), tiny(model_factory, block_allocator=PlainLRU())
    assert mine.llm_engine.block_manager.free_blocks.inner.inner is mine.llm_engine.config.block_allocator
    for params in (GREEDY, SAMPLED, GREEDY):  # the third run finds the first run's prefixes, or not
        assert run(mine, params) == run(lru, params)
        assert list(mine.llm_engine.block_manager.free_blocks) == list(lru.llm_engine.block_manager.free_blocks)
        assert mine.get_stats().prefix_cache_hits == lru.get_stats().prefix_cache_hits


@pytest.mark.parametrize("make", [MostRecentFirst, LowestFirst])
def test_where_the_blocks_lie_never_changes_the_tokens(model_factory, make):
    lru, mine = tiny(model_factory), tiny(model_factory, block_allocator=make())
    for params in (GREEDY, SAMPLED):
        assert run(mine, params) == run(lru, params)
    assert list(mine.llm_engine.block_manager.free_blocks) != list(lru.llm_engine.block_manager.free_blocks)
