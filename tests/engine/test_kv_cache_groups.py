"""KV-cache groups without a model: the sliding-window group gives back what left the window, a prefix hit
needs the window's blocks, a repeated prompt shares both groups, a rollback restores both pools."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.core.block_manager import NULL_BLOCK, BlockManager
from minivllm.engine.core.kv_cache_groups import KVCacheCoordinator
from minivllm.engine.core.sliding_window import SlidingWindowBlockManager
from minivllm.engine.request.journal import Journal
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.worker.kv_cache import sliding_pool_blocks
from minivllm.sampling_params import SamplingParams

B, W = 4, 8


def coordinator(full: int = 32, sliding: int = 16, prefix_caching: bool = True, window: int = W) -> KVCacheCoordinator:
    return KVCacheCoordinator(BlockManager(full, B, prefix_caching),
                              SlidingWindowBlockManager(sliding, B, window, prefix_caching))


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def step(kv: KVCacheCoordinator, s: Sequence, n: int) -> None:
    """What one step does to a running sequence: slots for n tokens, computed, published."""
    assert kv.can_append(s, n)
    kv.append_slots(s, n)
    s.num_computed_tokens += n
    kv.trim(s, s.num_tokens)  # the commit's part (caching: at allocation)


def held(s: Sequence) -> list[int]:
    return [b for b in s.sliding_block_table if b != NULL_BLOCK]


def decode(kv: KVCacheCoordinator, s: Sequence, num_tokens: int) -> None:
    for _ in range(num_tokens):
        s.append_token(1)
        step(kv, s, 1)


def test_a_decoding_request_holds_a_window_of_blocks_however_long_it_grows():
    kv = coordinator()
    s = seq("a", list(range(30)))
    prefix = kv.get_computed_blocks(s)
    kv.allocate(s, 12, prefix)  # a chunk, then the rest of the prompt
    s.num_computed_tokens = 12
    step(kv, s, 18)
    for _ in range(40):
        decode(kv, s, 1)
        assert len(held(s)) <= kv.sliding.max_blocks_per_decode <= -(-W // B) + 1  # the bound, mid-decode
        assert len(s.block_table) == -(-s.num_tokens // B)  # the full group keeps everything
        kv.check_invariants([s])
    first = kv.sliding.first_needed_block(s.num_computed_tokens)
    assert s.sliding_block_table[:first - 1] == [NULL_BLOCK] * (first - 1)  # the blocks before are given back
    assert kv.kv_blocks_in_use == {"full_attention": len(s.block_table), "sliding_attention": len(held(s))}
    kv.free(s)
    assert kv.num_free_blocks == kv.num_blocks == 48
    kv.check_invariants([])


def test_a_prefix_hit_needs_the_blocks_of_the_window_before_it():
    kv = coordinator()
    prompt = list(range(100, 133))  # 33 tokens: 8 full blocks can hit
    a = seq("a", prompt)
    kv.allocate(a, len(prompt), kv.get_computed_blocks(a))
    a.num_computed_tokens = len(prompt)
    kv.trim(a, a.num_tokens)  # the commit's part (caching: at allocation)
    kv.free(a)  # every block back to its pool, still findable
    b = seq("b", prompt)
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 32
    first = kv.sliding.first_needed_block(32)  # the query at 32 reads keys 25..32: blocks 6 and 7
    assert hit.sliding.blocks[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in hit.sliding.blocks[first:]
    # Reuse the sliding pool's block 7 (the window's last): no hit may read it, so the hit ends before it.
    seventh = kv.sliding.hash_to_block[b.block_hashes[7]]
    kv.sliding.free_blocks.revive(seventh)
    kv.sliding._forget_hash(seventh)
    kv.sliding.free_blocks.give_back(seventh, 10_000)
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 7 * B and len(hit.full.blocks) == len(hit.sliding.blocks) == 7
    kv.allocate(b, len(prompt) - hit.num_tokens, hit)
    assert b.num_computed_tokens == 28
    kv.check_invariants([b])


def test_no_window_blocks_no_hit_at_all():
    kv = coordinator(sliding=4)  # a small sliding pool: a long prompt's early blocks are reused by its own end
    prompt = list(range(200, 221))
    a = seq("a", prompt)
    kv.allocate(a, 8, kv.get_computed_blocks(a))
    a.num_computed_tokens = 8
    kv.trim(a, a.num_tokens)  # the commit's part (caching: at allocation)
    step(kv, a, 8)
    step(kv, a, 5)
    kv.free(a)
    b = seq("b", prompt[:9] + [7] * 12)  # shares 2 blocks, whose sliding copies were reused
    assert kv.full.get_computed_blocks(b).num_tokens == 8
    assert kv.get_computed_blocks(b).num_tokens == 0


def test_a_sibling_shares_both_groups_and_recomputes_the_partial_block():
    """An n > 1 request's second sequence (or any repeat of the prompt) admitted in the same step: both
    groups' full blocks were cached when the first sequence's were allocated, so it holds them too and
    computes only the partly filled last block."""
    kv = coordinator()
    first, second = seq("p", list(range(22))), seq("1_p", list(range(22)))
    kv.allocate(first, 22, kv.get_computed_blocks(first))
    hit = kv.get_computed_blocks(second)
    kv.allocate(second, 22 - hit.num_tokens, hit)
    assert second.num_computed_tokens == 20 and second.block_table[:5] == first.block_table[:5]
    window = kv.sliding.first_needed_block(20)  # the blocks its first query reads; none before (NULL)
    assert second.sliding_block_table[:window] == [NULL_BLOCK] * window
    assert second.sliding_block_table[window:5] == first.sliding_block_table[window:5]
    assert second.block_table[5] != first.block_table[5]  # its own last block
    kv.check_invariants([first, second])


def test_a_sibling_finds_its_whole_window_after_a_chunk_that_ended_mid_block():
    """A sibling starts at the first one's last block boundary (8 here), whose window (keys 3..8 for W = 6)
    reaches block 0; a chunk that ended at 10 must not have given block 0 back (its own window starts at 5)."""
    kv = coordinator(window=6)
    first = seq("p", list(range(11)))
    kv.allocate(first, 10, kv.get_computed_blocks(first))
    first.num_computed_tokens = 10
    kv.trim(first, first.num_tokens)  # the commit's part
    step(kv, first, 1)
    second = seq("1_p", list(range(11)))
    hit = kv.get_computed_blocks(second)
    kv.allocate(second, 11 - hit.num_tokens, hit)
    held = kv.sliding.first_needed_block(second.num_computed_tokens)
    assert second.num_computed_tokens == 8 and NULL_BLOCK not in second.sliding_block_table[held:]
    kv.check_invariants([first, second])


def test_a_rollback_restores_both_pools_and_both_tables():
    kv = coordinator()
    s = seq("a", list(range(26)))
    kv.allocate(s, 26, kv.get_computed_blocks(s))
    s.num_computed_tokens = 26
    kv.trim(s, s.num_tokens)  # the commit's part (caching: at allocation)
    before = (list(s.block_table), list(s.sliding_block_table), list(kv.full.free_blocks),
              list(kv.sliding.free_blocks), list(kv.sliding.ref_counts))
    journal = Journal()
    journal.watch(kv)
    journal.watch(s)
    journal.begin()
    s.append_token(5)
    kv.append_slots(s, 6)  # frees blocks that left the window, takes new ones in both pools
    assert s.sliding_block_table != before[1]
    journal.rollback()
    after = (list(s.block_table), list(s.sliding_block_table), list(kv.full.free_blocks),
             list(kv.sliding.free_blocks), list(kv.sliding.ref_counts))
    assert after == before
    kv.check_invariants([s])


def test_the_sliding_pool_is_sized_for_every_running_window():
    assert sliding_pool_blocks(W, B, max_num_seqs=3, max_num_batched_tokens=16) == 3 * (2 + 2 + 1) + 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9)), min_size=1, max_size=40))
def test_ownership_holds_in_both_groups_whatever_the_steps(moves):
    """Three requests growing by random chunks, freed and restarted: each pool's invariants hold throughout."""
    kv = coordinator(full=24, sliding=12)
    seqs = [seq(f"s{i}", list(range(i * 50, i * 50 + 5))) for i in range(3)]
    running: set[int] = set()
    for who, n in moves:
        s = seqs[who]
        if who not in running:
            prefix = kv.get_computed_blocks(s)
            if kv.can_allocate(s, 1, prefix):
                kv.allocate(s, 1, prefix)
                s.num_computed_tokens += 1
                kv.trim(s, s.num_tokens)  # the commit's part (caching: at allocation)
                running.add(who)
        elif n == 9:  # finish it: a later start may hit what it cached
            kv.free(s)
            s.num_computed_tokens = 0
            running.discard(who)
        else:
            while s.num_tokens < s.num_computed_tokens + n:
                s.append_token(n)
            if kv.can_append(s, n):
                step(kv, s, n)
                assert len(held(s)) <= -(-(W + n) // B) + 1
        kv.check_invariants([seqs[i] for i in running])
