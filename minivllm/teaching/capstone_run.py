"""`ScenarioRun`: a real `Scheduler` under a student's policy, stepped the way the engine steps it, without a model.

The capstone's behaviour checks (teaching/policy_behaviour.py, teaching/capstone_fair_share.py) each run
one small scenario through this: requests arrive (`add`, an n > 1 request as its n sibling sequences,
fanned out as the engine's front end does), and each `step` is the engine's transaction —
`begin_step`, `schedule`, `commit_step`, `update_from_output` (LLMEngine._step) — with every row that
samples getting token 7. The run records, per sequence, the step it arrived, first ran, was preempted
and finished, and per step which sequences were admitted: what the rules are judged on.

The policy runs inside `WatchedPolicy` (teaching/capstone_watch.py): the seam's contract, and no write
into a request, are checked on every call of every scenario.
"""

from __future__ import annotations

from collections import defaultdict

from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.core.scheduling_policy import SchedulingPolicy
from minivllm.engine.processing.parallel_sampling import fan_out
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import ModelRunnerOutput, RowGroupOutput, SampledToken
from minivllm.sampling_params import SamplingParams
from minivllm.teaching.capstone_watch import WatchedPolicy


class PolicyBehaviourError(AssertionError):
    """A policy kept the seam's contract but scheduled badly (the rule is in the message)."""


def fail(name: str, rule: str, seen: str) -> PolicyBehaviourError:
    return PolicyBehaviourError(f"{name} broke a RULE: {rule}; {seen}")


class ScenarioRun:
    """A scheduler under the policy, stepped without a model (module docstring)."""

    def __init__(self, policy: SchedulingPolicy, *, max_num_seqs: int, num_blocks: int, block_size: int = 4,
                 budget: int = 64) -> None:
        self.name = type(policy).__name__
        self.watched = WatchedPolicy(policy, running=lambda: self.sched.running)
        self.sched = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=budget, max_model_len=256, policy=self.watched)
        self.step_no, self.count = 0, 0
        self.seqs: dict[str, Sequence] = {}
        self.arrived: dict[str, int] = {}
        self.started: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.preemptions: dict[str, list[int]] = defaultdict(list)
        self.admitted: list[list[Sequence]] = []  # per step: the sequences admitted (first run or re-run)

    def add(self, prompt_len: int, max_tokens: int, priority: int, n: int = 1) -> Sequence:
        """One request arrives now (n > 1: its n sibling sequences); returns the first sequence."""
        seq = Sequence(f"r{self.count}", [5 + (self.count + i) % 90 for i in range(prompt_len)],
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n), arrival_index=self.count,
                       priority=priority)
        self.count += 1
        for s in fan_out(seq):
            self.seqs[s.request_id] = s
            self.arrived[s.request_id] = self.step_no
            self.sched.add_sequence(s)
        return seq

    def step(self) -> list[Sequence]:
        """One engine step (the transaction, module docstring); returns the requests it preempted."""
        sched = self.sched
        waiting = {id(s) for s in sched.waiting}
        sched.begin_step()
        out = sched.schedule()
        sched.commit_step()
        self.admitted.append([s.seq for s in out.scheduled if id(s.seq) in waiting])
        for s in out.scheduled:
            self.started.setdefault(s.seq.request_id, self.step_no)
        for s in out.preempted:
            self.preemptions[s.request_id].append(self.step_no)
        rows = [RowGroupOutput([SampledToken(7)]) if s.samples else RowGroupOutput() for s in out.scheduled]
        sched.update_from_output(out, ModelRunnerOutput(rows))
        for s in out.scheduled:
            if s.seq.is_finished:
                self.finished.setdefault(s.seq.request_id, self.step_no)
        self.step_no += 1
        return out.preempted

    def drain(self, most: int = 3000) -> None:
        for _ in range(most):
            if self.sched.is_finished():
                self.step()  # one more call on an empty queue: the policy may prune here too
                return
            self.step()
        raise fail(self.name, "every request finishes once arrivals stop (the scheduler drains)",
                   f"{len(self.sched.live_sequences)} still live after {most} steps")

    def first_victim(self, priorities: list[int]) -> tuple[list[Sequence], Sequence]:
        """The victim probe: one request per priority arrives per step (in the order given), sized so that all
        of them fill the pool and need their second block in the same step; the first running one asks,
        so every running request is a candidate. Returns the running requests (admission order) and the
        one the policy preempted first. (Prompt of request j: 5 - k + j tokens, block size 4, k <= 4.)"""
        k = len(priorities)
        assert self.sched.block_manager.num_blocks == k and 1 <= k <= 4, "the probe's pool holds one block per request"
        for j, priority in enumerate(priorities):
            self.add(prompt_len=5 - k + j, max_tokens=8, priority=priority)
            assert not self.step(), "nobody needs a second block before every request runs"
        running = list(self.sched.running)
        preempted = self.step()
        return running, preempted[0]

    def history(self, request_id: str) -> str:
        """When a request arrived, first ran, was preempted and finished: what an error message shows."""
        pre = self.preemptions.get(request_id, [])
        done = self.finished.get(request_id)
        return (f"{request_id} arrived at step {self.arrived[request_id]}, first ran at step "
                f"{self.started.get(request_id, 'never')}, was preempted {len(pre)} time(s)"
                + (f" (steps {pre})" if pre else "") + f", finished at step {done if done is not None else 'never'}")
