"""A failed step whose preemption handed the victim's blocks to another request.

Blocks freed by a preemption are reused in the same step (that is what the preemption is for), and the
forward writes the new owner's K/V into them. If that step then fails, its rollback cannot give the
victim its blocks back as they were: their K/V (and, for a full block, what its prefix-cache hash
promises) now hold someone else's tokens. The rollback keeps that preemption instead: the victim
recomputes, and a block the step wrote is never findable in the prefix cache while free."""

from __future__ import annotations

from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.request.sequence import Sequence, SequenceStatus
from minivllm.engine.request.step_types import ModelRunnerOutput
from minivllm.sampling_params import SamplingParams

B = 4  # block size


def scheduler(num_blocks: int) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, B), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                     eos_token_ids=frozenset({1}), enable_chunked_prefill=True, max_admission_skips=8)


def committed_step(sched: Scheduler) -> None:
    sched.begin_step()
    out = sched.schedule()
    sched.commit_step()
    sched.update_from_output(out, ModelRunnerOutput.from_token_ids([7 if s.samples else None for s in out.scheduled]))


def computed_blocks(seq: Sequence) -> set[int]:
    return set(seq.block_table[:-(-seq.num_computed_tokens // B)])


def test_a_victim_never_gets_back_blocks_the_failed_step_wrote():
    sched = scheduler(num_blocks=5)
    a = Sequence("a", list(range(10, 18)), SamplingParams(max_tokens=8, ignore_eos=True), arrival_index=0)  # 2 blocks
    c = Sequence("c", list(range(30, 40)), SamplingParams(max_tokens=8, ignore_eos=True), arrival_index=1)  # 3 blocks
    for s in (a, c):
        sched.add_sequence(s)
    committed_step(sched)  # both prefilled: a 8 computed (2 full blocks), c 10 (2 full and a partial)
    assert sched.block_manager.num_free_blocks == 0 and c.num_computed_tokens % B  # c's last block holds K/V
    cached = dict(sched.block_manager.hash_to_block)
    assert set(cached.values()) & set(c.block_table)  # c's full blocks are findable

    c_blocks = list(c.block_table)
    sched.begin_step()
    plan = sched.schedule()  # a needs a third block: c (the newest) is preempted, a takes c's freed blocks
    assert plan.preempted == [c] and [s.seq for s in plan.scheduled] == [a]
    written = {b for s in plan.scheduled  # the blocks the forward writes the plan's new K/V into
               for b in s.seq.block_table[s.start // B:(s.start + s.num_new_tokens - 1) // B + 1]}
    stolen = written & set(c_blocks)
    assert stolen  # the block a writes was c's a moment ago
    sched.rollback_step(plan)  # the forward failed after writing a's K/V

    sched.block_manager.check_invariants(sched.live_sequences)
    assert not computed_blocks(c) & stolen, c  # c holds no computed K/V that the failed step overwrote...
    assert not written & set(sched.block_manager.hash_to_block.values())  # ...nor can find it in the cache
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and not c.block_table  # it recomputes
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 8 and len(a.block_table) == 2
    for _ in range(40):  # and both finish
        if not sched.running and not sched.waiting:
            break
        committed_step(sched)
    assert a.is_finished and c.is_finished and sched.block_manager.num_free_blocks == 5


def test_a_failed_step_without_reuse_still_changes_nothing():
    sched = scheduler(num_blocks=8)
    a = Sequence("a", list(range(10, 18)), SamplingParams(max_tokens=8, ignore_eos=True), arrival_index=0)
    sched.add_sequence(a)
    committed_step(sched)
    before = (list(a.block_table), a.num_computed_tokens, list(sched.block_manager.ref_counts))
    sched.begin_step()
    plan = sched.schedule()
    sched.rollback_step(plan)
    assert (list(a.block_table), a.num_computed_tokens, list(sched.block_manager.ref_counts)) == before
    assert a.status is SequenceStatus.RUNNING and sched.num_preemptions == 0


def test_a_rolled_back_admission_still_leaves_its_prompt_a_token_to_compute():
    """Blocks are hashed when allocated, so a rolled-back admission leaves its sequence knowing the hash of
    its prompt's last block. If an earlier request cached that whole block, the retry must still compute
    the prompt's last token (its logits are what the first token is drawn from), never hit everything."""
    sched = scheduler(num_blocks=16)
    prompt = list(range(10, 18))  # 2 full blocks
    first = Sequence("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True), arrival_index=0)
    sched.add_sequence(first)
    while not sched.is_finished():  # computes both prompt blocks (and caches them)
        committed_step(sched)
    again = Sequence("b", prompt, SamplingParams(max_tokens=3, ignore_eos=True), arrival_index=1)
    sched.add_sequence(again)
    sched.begin_step()
    plan = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in plan.scheduled] == [(4, 4)]
    assert len(again.block_hashes) == 2  # both blocks hashed at allocation
    sched.rollback_step(plan)  # the forward failed
    sched.begin_step()
    retry = sched.schedule()
    sched.commit_step()
    assert [(s.start, s.num_new_tokens) for s in retry.scheduled] == [(4, 4)]
