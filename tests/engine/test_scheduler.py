"""Scheduler without a model: budgets, mixed batches, chunking, skipping, starvation, preemption."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sampling_metadata import RowGroupOutput, SampledToken
from minivllm.engine.scheduler import ScheduledSequence, Scheduler
from minivllm.engine.scheduling_policy import PriorityPolicy
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

EOS = 1


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=16, chunked=True, skips=8, max_len=256,
                   spec=0):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                     eos_token_ids=frozenset({EOS}), enable_chunked_prefill=chunked, max_admission_skips=skips,
                     num_speculative_tokens=spec)


def seq(rid: str, n: int, max_tokens: int = 4, start: int = 10, n_seqs: int = 1) -> Sequence:
    return Sequence(rid, list(range(start, start + n)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n_seqs), arrival_index=int(rid[1:]))


def fake_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = [token if s.samples else None for s in out.scheduled]
    sched.postprocess(out, sampled)
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
        sched.add_sequence(seq(f"r{i}", 5))
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [5, 5, 2]  # the third gets a partial chunk


def test_without_chunking_a_too_long_prompt_is_skipped_not_blocking():
    sched = make_scheduler(budget=8, chunked=False)
    sched.add_sequence(seq("r0", 6))
    sched.add_sequence(seq("r1", 6))
    sched.add_sequence(seq("r2", 2))
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
    sched.postprocess(out, [7] * 2)
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
    """The MinivLLM docs' loop: add_sequence / schedule / postprocess / is_finished."""
    sched = make_scheduler()
    for i in range(3):
        sched.add_sequence(seq(f"r{i}", 5 + i, max_tokens=3))
    steps = 0
    while not sched.is_finished():
        out = sched.schedule()
        token_ids = [42 if s.samples else None for s in out.scheduled]
        sched.postprocess(out, token_ids)
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


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort against a tiny pool; invariants after every action. Steps include
    speculative drafts (random proposals, random acceptance) and n > 1 forks."""

    @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from([1, 2, 4]),
                budget=st.integers(2, 24), chunked=st.booleans(), seed=st.integers(0, 1000),
                spec=st.integers(0, 3))
    def setup(self, num_blocks, block_size, budget, chunked, seed, spec):
        self.sched = make_scheduler(num_blocks, block_size, max_num_seqs=4, budget=budget, chunked=chunked,
                                    skips=3, max_len=64 if chunked else budget, spec=spec)
        self.rng = random.Random(seed)
        self.count = 0
        self.live: dict[str, Sequence] = {}

    @rule(n=st.integers(1, 20), max_tokens=st.integers(1, 12), n_seqs=st.sampled_from([1, 1, 2, 3]))
    def add(self, n, max_tokens, n_seqs):
        bm = self.sched.block_manager
        final = min(n + max_tokens, self.sched.max_model_len)
        if n >= self.sched.max_model_len or bm.blocks_needed(final - 1) > bm.num_blocks:
            return  # the engine refuses these before they reach the scheduler
        s = seq(f"r{self.count}", n, max_tokens=max_tokens, start=self.rng.randrange(2, 50), n_seqs=n_seqs)
        self.count += 1
        self.live[s.request_id] = s
        self.sched.add_sequence(s)

    @rule()
    def step(self):
        out = self.sched.schedule()
        outputs = []
        for i, s in enumerate(out.scheduled):
            token = SampledToken(self.rng.choice([EOS, 7, 8]))
            if s.num_spec_tokens:  # a proposer drafts d <= k tokens; the target accepts a <= d
                d = self.rng.randint(0, s.num_spec_tokens)
                s.seq.spec_token_ids = [self.rng.choice([7, 8]) for _ in range(d)]
                out.scheduled[i] = ScheduledSequence(s.seq, s.start, s.num_new_tokens - s.num_spec_tokens + d, d)
                a = self.rng.randint(0, d)
                outputs.append(RowGroupOutput([SampledToken(t) for t in s.seq.spec_token_ids[:a]] + [token]))
            elif s.samples:
                forks = [SampledToken(self.rng.choice([EOS, 7])) for _ in range(s.seq.num_forks_pending)]
                outputs.append(RowGroupOutput([token], forks))
            else:
                outputs.append(RowGroupOutput())
        self.sched.postprocess(out, outputs)

    @rule(data=st.data())
    def abort(self, data):
        alive = [s for s in self.sched.live_sequences if not s.is_finished]
        if alive:
            self.sched.finish(data.draw(st.sampled_from(alive)), "abort")

    @rule()
    def failed_step(self):
        before = [(s.request_id, s.status, s.num_computed_tokens, list(s.block_table), s.num_admission_skips)
                  for s in self.sched.live_sequences]
        bm = self.sched.block_manager
        pool = (list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block), list(bm.block_hash))
        self.sched.begin()
        self.sched.schedule()
        self.sched.rollback()
        after = [(s.request_id, s.status, s.num_computed_tokens, list(s.block_table), s.num_admission_skips)
                 for s in self.sched.live_sequences]
        assert after == before
        assert (list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block), list(bm.block_hash)) == pool

    @invariant()
    def blocks_are_consistent(self):
        if hasattr(self, "sched"):
            bm = self.sched.block_manager
            bm.check_invariants(self.sched.live_sequences)
            assert all(s.status is SequenceStatus.RUNNING for s in self.sched.running)
            for s in self.sched.live_sequences:  # rejected drafts leave no trace
                assert not s.spec_token_ids and len(s.block_table) <= bm.blocks_needed(s.num_tokens)
                assert s.num_computed_tokens < s.num_tokens

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if self.sched.is_finished():
                break
            self.step()
        assert self.sched.is_finished(), "the scheduler failed to drain"
        bm = self.sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        bm.check_invariants([])


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase


class PriorityMachine(SchedulerMachine):
    """The same random walk under the "priority" policy: the invariants hold for any policy."""

    @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from([1, 2, 4]),
                budget=st.integers(2, 24), chunked=st.booleans(), seed=st.integers(0, 1000),
                spec=st.integers(0, 2))
    def setup(self, num_blocks, block_size, budget, chunked, seed, spec):
        super().setup(num_blocks, block_size, budget, chunked, seed, spec)
        self.sched.policy = PriorityPolicy()

    @rule(n=st.integers(1, 20), max_tokens=st.integers(1, 12), priority=st.integers(-2, 2))
    def add_with_priority(self, n, max_tokens, priority):
        self.add(n, max_tokens, 1)
        if self.sched.waiting:
            self.sched.waiting[-1].priority = priority


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
