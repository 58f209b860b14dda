"""The scheduler's hypothesis state machine, for any scheduling policy (and the policy's contract).

    machine = scheduler_machine(PriorityPolicy, priorities=True)
    run_state_machine_as_test(machine)          # or: TestScheduler = machine.TestCase, under pytest
    scheduler_machine(make_allocator=MyAllocator)   # a block allocator of your own under the same rules

hypothesis drives a `Scheduler` on a tiny pool through random actions — add a request (n > 1: its n
sequences, sharing the prompt through the prefix cache; with a priority), step (`schedule` then
`update_from_output`; speculative drafts attached after the commit, as the engine's proposer does, some
accepted), abort, and a failed step that is rolled back — and after every action checks the block
manager's invariants: every block is owned or free, ref counts match the block tables, a rolled-back
step leaves no trace. At the end every request must finish and every block come back. When an action
breaks a rule, hypothesis shrinks the run to the shortest one that still breaks it.

The project's own tests run this machine on the built-in policies (tests/engine/test_scheduler.py),
and the capstone's grader runs the very same one on a student's policy (teaching/capstone.py), wrapped
in `CheckedPolicy` (engine/core/scheduling_policy.py, which the engine's scheduler wraps every policy in too):
it names the rule of the seam a policy breaks (`PolicyContractError`). A block allocator
(`make_allocator`, engine/core/block_allocator.py) is wrapped in `CheckedAllocator` the same way
(`AllocatorContractError`); the invariants and the exact rollback must hold whichever block it hands out.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from minivllm.engine.core.block_allocator import BlockAllocator
from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.core.scheduling_policy import CheckedPolicy, FCFSPolicy, SchedulingPolicy
from minivllm.engine.processing.parallel_sampling import fan_out
from minivllm.engine.request.sequence import FinishReason, Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

EOS = 1  # the machine's end-of-sequence token: a request that samples it finishes


def _checked(policy: SchedulingPolicy) -> CheckedPolicy:
    """The policy under the seam's contract: wrapped in `CheckedPolicy` unless it already is one (the capstone's
    `WatchedPolicy`, teaching/capstone_watch.py, which also refuses a policy that changes a request)."""
    return policy if isinstance(policy, CheckedPolicy) else CheckedPolicy(policy)


def scheduler_machine(make_policy: Callable[[], SchedulingPolicy] = FCFSPolicy, *, priorities: bool = False,
                      max_spec: int = 3, make_allocator: Callable[[], BlockAllocator] | None = None) -> type:
    """The scheduler's hypothesis state machine, for any policy: random add / step / abort / failed
    step against a tiny pool (speculative drafts and n > 1 requests included), the block manager's
    invariants after every action, and a full drain at the end. `priorities`: also add requests with
    random priorities in -2..2. Run it with `run_state_machine_as_test(machine)` or as
    `machine.TestCase` under pytest. The policy is wrapped in `CheckedPolicy` (unless it is one).
    `make_allocator`: the block manager's allocator (None: the default LRU), wrapped in `CheckedAllocator`."""
    import hypothesis.strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

    from minivllm.engine.request.step_types import DraftTokenIds, ModelRunnerOutput, RowGroupOutput, SampledToken

    class SchedulerMachine(RuleBasedStateMachine):
        @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from([1, 2, 4]),
                    budget=st.integers(2, 24), chunked=st.booleans(), seed=st.integers(0, 1000),
                    spec=st.integers(0, max_spec))
        def setup(self, num_blocks: int, block_size: int, budget: int, chunked: bool, seed: int, spec: int) -> None:
            allocator = make_allocator() if make_allocator is not None else None
            self.sched = Scheduler(BlockManager(num_blocks, block_size, allocator=allocator), max_num_seqs=4,
                                   max_num_batched_tokens=budget, max_model_len=64 if chunked else budget,
                                   eos_token_ids=frozenset({EOS}),
                                   enable_chunked_prefill=chunked, max_admission_skips=3,
                                   policy=_checked(make_policy()))
            self.num_speculative_tokens = spec
            self.rng = random.Random(seed)
            self.count = 0

        def _add(self, n: int, max_tokens: int, n_seqs: int, priority: int = 0) -> None:
            bm = self.sched.block_manager
            final = min(n + max_tokens, self.sched.max_model_len)
            if n >= self.sched.max_model_len or bm.blocks_needed(final - 1) > bm.num_blocks:
                return  # the engine refuses these before they reach the scheduler
            start = self.rng.randrange(2, 50)
            s = Sequence(f"r{self.count}", list(range(start, start + n)),
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n_seqs),
                         arrival_index=self.count, priority=priority)
            self.count += 1
            for seq in fan_out(s):  # n > 1: n plain sequences, as the engine queues them
                self.sched.add_sequence(seq)

        @rule(n=st.integers(1, 20), max_tokens=st.integers(1, 12), n_seqs=st.sampled_from([1, 1, 2, 3]))
        def add(self, n: int, max_tokens: int, n_seqs: int) -> None:
            self._add(n, max_tokens, n_seqs)

        if priorities:
            @rule(n=st.integers(1, 20), max_tokens=st.integers(1, 12), priority=st.integers(-2, 2))
            def add_with_priority(self, n: int, max_tokens: int, priority: int) -> None:
                self._add(n, max_tokens, 1, priority)

        @rule()
        def step(self) -> None:
            out = self.sched.schedule()
            outputs = []
            for s in out.scheduled:
                token = SampledToken(self.rng.choice([EOS, 7, 8]))
                assert s.num_spec_tokens <= len(s.seq.spec_token_ids), "more draft slots than drafts"
                if s.num_spec_tokens:  # the target accepts a <= d of the d drafts verified
                    a = self.rng.randint(0, s.num_spec_tokens)
                    outputs.append(RowGroupOutput([SampledToken(t) for t in s.seq.spec_token_ids[:a]] + [token]))
                elif s.samples:
                    outputs.append(RowGroupOutput([token]))
                else:
                    outputs.append(RowGroupOutput())
            self.sched.update_from_output(out, ModelRunnerOutput(outputs))
            drafts = DraftTokenIds([], [], [])
            for seq in self.sched.running:  # a proposer drafts d <= k tokens after the commit
                room = min(self.num_speculative_tokens, self.sched.draft_room(seq))
                if room:
                    drafts.req_ids.append(seq.request_id)
                    drafts.draft_token_ids.append([self.rng.choice([7, 8]) for _ in range(self.rng.randint(0, room))])
                    drafts.draft_probs.append(None)
            self.sched.update_draft_token_ids(drafts)

        @rule(data=st.data())
        def abort(self, data: Any) -> None:
            alive = [s for s in self.sched.live_sequences if not s.is_finished]
            if alive:
                self.sched.finish(data.draw(st.sampled_from(alive)), FinishReason.ABORT)

        @rule()
        def failed_step(self) -> None:
            def snapshot() -> tuple:
                bm = self.sched.block_manager
                seqs = [(s.request_id, s.status, s.num_computed_tokens, list(s.block_table), s.num_admission_skips)
                        for s in self.sched.live_sequences]
                return seqs, list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block), list(bm.block_hash)

            before = snapshot()
            self.sched.begin_step()
            self.sched.schedule()
            self.sched.rollback_step()
            assert snapshot() == before, "a rolled-back step must leave the scheduler exactly as it was"

        @invariant()
        def blocks_are_consistent(self) -> None:
            if hasattr(self, "sched"):
                bm = self.sched.block_manager
                bm.check_invariants(self.sched.live_sequences)
                assert all(s.status is SequenceStatus.RUNNING for s in self.sched.running)
                assert len(self.sched.running) <= self.sched.max_num_seqs, "more sequences than max_num_seqs"
                # drafts wait on decoding sequences only; rejected ones leave no trace
                for s in self.sched.live_sequences:
                    assert len(s.spec_token_ids) <= self.sched.draft_room(s)
                    assert len(s.block_table) <= bm.blocks_needed(s.num_tokens)
                    assert s.num_computed_tokens < s.num_tokens

        def teardown(self) -> None:
            if not hasattr(self, "sched"):
                return
            for _ in range(2000):
                if self.sched.is_finished():
                    break
                self.step()
            assert self.sched.is_finished(), "RULE: every request must finish (the scheduler failed to drain)"
            bm = self.sched.block_manager
            assert bm.num_free_blocks == bm.num_blocks
            bm.check_invariants([])

    allocator_name = "" if make_allocator is None else f", {getattr(make_allocator, '__name__', 'allocator')}"
    SchedulerMachine.__name__ = f"SchedulerMachine[{getattr(make_policy, '__name__', 'policy')}{allocator_name}]"
    return SchedulerMachine
