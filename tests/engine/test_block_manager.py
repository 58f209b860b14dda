"""BlockManager without a model: allocation, ref counts, prefix hashing, LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.request.journal import Journal
from minivllm.engine.request.sequence import Sequence
from minivllm.sampling_params import SamplingParams


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What a step does to a sequence it fully prefills: allocate, compute, publish."""
    prefix = bm.get_computed_blocks(s)
    n = s.num_tokens - prefix.num_tokens
    assert bm.can_allocate(s, n, prefix)
    bm.allocate(s, n, prefix)
    s.num_computed_tokens = s.num_tokens
    bm.trim(s, s.num_tokens)  # the commit's part (caching: at allocation)


def test_allocate_and_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(10)))  # 3 blocks
    run_prefill(bm, a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    bm.check_invariants([a])
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == []
    bm.check_invariants([])


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq("a", list(range(12)))  # exactly 3 full blocks
    run_prefill(bm, a)
    b = seq("b", list(range(12)))
    match = bm.get_computed_blocks(b)
    # (12 - 1) // 4 = 2 blocks may hit: the last token must still be computed to get logits.
    assert match.blocks == a.block_table[:2] and match.num_tokens == 8
    bm.allocate(b, 4, match)
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    assert b.block_table[2] != a.block_table[2]
    bm.check_invariants([a, b])
    assert bm.num_hit_tokens == 8 and bm.num_queried_tokens == 24


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    run_prefill(bm, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: no hit at all.
    assert bm.get_computed_blocks(seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])).num_tokens == 0
    assert bm.get_computed_blocks(seq("c", [1, 2, 3, 4, 5, 6, 7, 8, 0])).num_tokens == 8


def test_freed_cached_blocks_stay_findable_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(9)))
    run_prefill(bm, a)
    first_two = a.block_table[:2]
    bm.free(a)
    assert bm.get_computed_blocks(seq("x", list(range(9)))).blocks == first_two
    # Reviving a free cached block takes it out of the free queue.
    b = seq("b", list(range(9)))
    run_prefill(bm, b)
    assert b.block_table[:2] == first_two and bm.num_free_blocks == 1
    bm.free(b)
    # Filling the pool with other tokens evicts the cached blocks (LRU).
    c = seq("c", [100 + i for i in range(16)])
    run_prefill(bm, c)
    assert bm.get_computed_blocks(seq("y", list(range(9)))).num_tokens == 0
    bm.check_invariants([c])


def test_lru_evicts_tail_blocks_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = seq("a", list(range(7)))  # 4 blocks, 3 full
    run_prefill(bm, a)
    bm.free(a)
    other = seq("o", [50, 51, 52])  # needs 2 blocks: the 2 never-used ones
    run_prefill(bm, other)
    assert bm.get_computed_blocks(seq("z", list(range(7)))).num_tokens == 6
    bm.free(other)
    # Free queue, oldest first: a's blocks tail-first (partial, 3rd, 2nd, 1st), then o's.
    newer = seq("n", [60, 61, 62])  # 2 blocks: a's partial block and its 3rd block go first
    run_prefill(bm, newer)
    assert bm.get_computed_blocks(seq("z", list(range(7)))).num_tokens == 4


def test_rollback_is_exact():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(9)))
    run_prefill(bm, a)
    state = (list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block), list(bm.block_hash),
             list(a.block_table), a.num_computed_tokens)
    journal = Journal()
    journal.watch(bm)
    journal.watch(a)
    journal.begin()
    b = seq("b", list(range(9)))
    run_prefill(bm, b)  # takes free blocks from the head of the queue, publishes hashes
    bm.free(a)
    journal.rollback()
    assert (list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block), list(bm.block_hash),
            list(a.block_table), a.num_computed_tokens) == state
    bm.check_invariants([a])


def test_rollback_puts_a_revived_cached_block_back_in_its_place():
    """A prefix hit takes a block from the MIDDLE of the LRU queue; a rollback must put it back there."""
    bm = BlockManager(num_blocks=8, block_size=4)
    for name, start in (("x", 100), ("a", 0), ("y", 200)):
        s = seq(name, list(range(start, start + 9)))
        run_prefill(bm, s)
        bm.free(s)
    queue = list(bm.free_blocks)
    journal = Journal()
    journal.watch(bm)
    journal.begin()
    hit = seq("b", list(range(9)))
    prefix = bm.get_computed_blocks(hit)
    assert prefix.num_tokens == 8
    bm.allocate(hit, 1, prefix)
    assert list(bm.free_blocks) != queue
    journal.rollback()
    assert list(bm.free_blocks) == queue
    bm.check_invariants([])


def test_prefix_keys_are_sha256_over_parent_and_tokens():
    import hashlib
    from array import array

    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq("a", list(range(9)))
    h0, h1 = bm.block_hashes(s, 2)
    assert h0 == hashlib.sha256(array("i", [0, 1, 2, 3]).tobytes()).digest()
    assert h1 == hashlib.sha256(h0 + array("i", [4, 5, 6, 7]).tobytes()).digest()
    # The same block of tokens under another parent is another key: K/V depend on the whole prefix.
    other = seq("o", [9, 9, 9, 9, 4, 5, 6, 7, 8])
    assert bm.block_hashes(other, 2)[1] != h1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=12), min_size=2, max_size=12))
def test_a_prefix_hit_only_ever_serves_the_same_tokens(prompts):
    """Whatever was cached before, a hit returns blocks whose tokens (and whole prefix) equal ours:
    two different blocks are never served for one another."""
    bm = BlockManager(num_blocks=8, block_size=2)  # small: blocks are evicted and reused
    owner: dict[int, tuple[int, ...]] = {}  # block -> the prefix it was last computed for
    for i, p in enumerate(prompts):
        s = seq(f"r{i}", p)
        prefix = bm.get_computed_blocks(s)
        for j, b in enumerate(prefix.blocks):
            assert owner[b] == tuple(p[:(j + 1) * 2])
        run_prefill(bm, s)
        for j in range(len(prefix.blocks), len(s.block_table)):
            owner[s.block_table[j]] = tuple(p[:(j + 1) * 2])
        bm.free(s)
        bm.check_invariants([])


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    run_prefill(bm, seq("a", list(range(9))))
    assert bm.get_computed_blocks(seq("b", list(range(9)))).num_tokens == 0
    assert bm.hash_to_block == {}
