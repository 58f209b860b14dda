"""Scheduler without a model: budgets, mixed batches, chunking, skipping, starvation, preemption."""

from __future__ import annotations

from hypothesis import settings

from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.core.scheduling_policy import FCFSPolicy, PriorityPolicy
from minivllm.engine.processing.parallel_sampling import fan_out
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import ModelRunnerOutput
from minivllm.sampling_params import SamplingParams
from minivllm.teaching.scheduler_machine import scheduler_machine

EOS = 1


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=16, chunked=True, skips=8, max_len=256):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                     eos_token_ids=frozenset({EOS}), enable_chunked_prefill=chunked, max_admission_skips=skips)


def seq(rid: str, n: int, max_tokens: int = 4, start: int = 10, n_seqs: int = 1) -> Sequence:
    return Sequence(rid, list(range(start, start + n)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n_seqs), arrival_index=int(rid[1:]))


def fake_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = [token if s.samples else None for s in out.scheduled]
    sched.update_from_output(out, ModelRunnerOutput.from_token_ids(sampled))
    return out


def test_running_first_then_admission_in_one_mixed_batch():
    sched = make_scheduler(budget=10)
    sched.add_sequence(seq("r0", 3))
    fake_step(sched)  # r0 prefilled, has its first token
    sched.add_sequence(seq("r1", 20))
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 1), ("r1", 9)]
    assert not out.scheduled[0].is_prefill and out.scheduled[1].is_prefill
    assert out.num_batched_tokens == 10 and not out.scheduled[1].samples  # a chunk, nothing to sample


def test_chunked_prefill_applies_to_every_admitted_request():
    sched = make_scheduler(budget=12)
    for i in range(3):
        sched.add_sequence(seq(f"r{i}", 5, start=10 * (i + 1)))  # different prompts: no prefix hits
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [5, 5, 2]  # the third gets a partial chunk


def test_without_chunking_a_too_long_prompt_is_skipped_not_blocking():
    sched = make_scheduler(budget=8, chunked=False)
    sched.add_sequence(seq("r0", 6))
    sched.add_sequence(seq("r1", 6, start=30))
    sched.add_sequence(seq("r2", 2, start=50))
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r2"]  # r1 skipped, r2 overtakes
    assert [s.request_id for s in sched.waiting] == ["r1"]


def test_no_head_of_line_blocking_on_blocks_and_starvation_guard():
    sched = make_scheduler(num_blocks=4, block_size=8, budget=64, skips=2)
    r0 = seq("r0", 8, max_tokens=7)  # ends with 14 computed tokens: 2 blocks
    sched.add_sequence(r0)
    fake_step(sched)
    sched.add_sequence(seq("r1", 24, start=100))  # needs 3 blocks: does not fit beside r0
    sched.add_sequence(seq("r2", 2, max_tokens=2, start=200))  # needs 1: fits, overtakes r1
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r2"]
    sched.update_from_output(out, ModelRunnerOutput.from_token_ids([7] * 2))
    # r1 keeps being skipped; once past max_admission_skips, nobody behind it is admitted.
    for _ in range(2):
        fake_step(sched)
    sched.add_sequence(seq("r3", 2, max_tokens=2, start=300))  # would fit, but r1 has waited too long
    fake_step(sched)
    assert not r0.is_finished and [s.request_id for s in sched.waiting] == ["r1", "r3"]
    assert sched.waiting[0].num_admission_skips > 2
    while not sched.is_finished():  # when r0 finishes, r1 goes first, then r3
        out = fake_step(sched)
        admitted = [s.seq.request_id for s in out.scheduled if s.start == 0]
        assert "r3" not in admitted or "r1" not in [s.request_id for s in sched.waiting]


def test_an_n_request_computes_the_full_blocks_of_its_prompt_once():
    """n = 3 is three plain sequences (engine/processing/parallel_sampling.py). Admitted in one step, the second and
    third hit the blocks the first is computing (cached when allocated): each computes only the prompt's
    partly filled last block, and all three hold the same full blocks."""
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64)
    for s in fan_out(seq("r0", 10, n_seqs=3)):
        sched.add_sequence(s)
    out = sched.schedule()
    assert [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == \
        [("r0", 0, 10), ("1_r0", 8, 2), ("2_r0", 8, 2)]
    tables = [s.seq.block_table for s in out.scheduled]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] and len({t[2] for t in tables}) == 3
    assert [s.seq.seed for s in out.scheduled] == [0, 1, 2]  # seed + i
    sched.update_from_output(out, ModelRunnerOutput.from_token_ids([7, 8, 9]))
    assert [s.output_token_ids for s in sched.running] == [[7], [8], [9]]


def test_preemption_takes_the_newest_and_puts_it_first_in_line():
    sched = make_scheduler(num_blocks=4, block_size=2, budget=64)
    for i in range(2):
        sched.add_sequence(seq(f"r{i}", 3, max_tokens=10))
    fake_step(sched)  # each holds 2 blocks, full pool
    fake_step(sched)  # tokens 4: still fits (2 blocks of 2)
    out = sched.schedule()  # token 5 needs a 3rd block for r0: r1 (newest) is preempted
    assert [s.request_id for s in out.preempted] == ["r1"]
    assert sched.waiting[0].request_id == "r1" and sched.waiting[0].num_computed_tokens == 0
    assert sched.num_preemptions == 1
    sched.block_manager.check_invariants(sched.live_sequences)


def test_teaching_api_loop_like_minivllm():
    """The MinivLLM docs' loop: add_sequence / schedule / postprocess / is_finished (postprocess is vLLM v1's
    update_from_output here)."""
    sched = make_scheduler()
    for i in range(3):
        sched.add_sequence(seq(f"r{i}", 5 + i, max_tokens=3))
    steps = 0
    while not sched.is_finished():
        out = sched.schedule()
        token_ids = [42 if s.samples else None for s in out.scheduled]
        sched.update_from_output(out, ModelRunnerOutput.from_token_ids(token_ids))
        steps += 1
    assert steps < 10
    assert sched.block_manager.num_free_blocks == 16


def test_stop_rules_eos_and_min_tokens():
    sched = make_scheduler()
    s = Sequence("r0", [5, 6], SamplingParams(max_tokens=10, min_tokens=2))
    sched.add_sequence(s)
    fake_step(sched, token=EOS)  # first output is EOS but min_tokens=2 keeps going
    assert not s.is_finished
    fake_step(sched, token=3)
    fake_step(sched, token=EOS)
    assert s.is_finished and s.finish_reason == "stop" and s.stop_reason is None


# The state machine lives in minivllm/teaching/scheduler_machine.py, so that the capstone's grader runs
# the very same machine against a student's policy.
SchedulerMachine = scheduler_machine(FCFSPolicy)
SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase
PriorityMachine = scheduler_machine(PriorityPolicy, priorities=True, max_spec=2)
PriorityMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPriorityMachine = PriorityMachine.TestCase


def test_priority_policy_admits_the_most_urgent_first_and_preempts_the_least():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    sched.policy = PriorityPolicy()
    low, high = seq("r0", 8, max_tokens=8), seq("r1", 8, max_tokens=8)
    low.priority, high.priority = 5, -1
    sched.add_sequence(low)
    sched.add_sequence(high)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled][0] == "r1"
    assert PriorityPolicy().choose_victim([high, low]) is low
