"""The capstone's behaviour checks: what a scheduling policy DOES, not only the seam's contract.

    check_policy_behaviour(MyPolicy)                        # priority with aging (the default)
    check_policy_behaviour(MyPolicy, Assignment.FAIR_SHARE) # fair share: the priority rules are not asked

A policy can keep the contract (every waiting request once, a victim among the candidates) and still
schedule badly: shortest-prompt-first ignores priorities, a policy that always preempts the requester
throws away the most urgent work, one that never forgets a finished request grows without bound. Each
check below runs a real `Scheduler` (no model: every row that samples gets token 7) through one small
scenario and raises `PolicyBehaviourError` naming the RULE and what was seen:

  1. priority order: two requests arrive together, one seat; the more urgent (lower `priority`) is
     admitted first even though it arrived second and its prompt is longer;
  2. the victim: two running requests, no free block; the least urgent one is preempted;
  3. bounded wait (open-loop arrivals): `max_num_seqs=2`, two urgent requests queued, one long
     low-priority request, then one short urgent arrival per step for `ARRIVAL_STEPS` steps. Priority
     alone never runs the long one while arrivals go on (the seats are always taken by someone more
     urgent); an aging policy must start it within `MAX_WAIT_STEPS` steps. The scheduler's
     anti-starvation hold cannot help here: it stops admission BEHIND a starving request in the
     policy's order, it never moves it forward (docs/concepts/scheduling.md);
  4. stale state: after the scenarios (hundreds of requests finished), the policy's own containers
     (dicts, lists, sets held as attributes) hold at most `MAX_STATE_ENTRIES` entries: state kept per
     request must be dropped once the request is no longer waiting;
  5. open load: random arrivals every step with mixed priorities under memory pressure (preemptions);
     every request starts within `MAX_WAIT_STEPS` of arriving and finishes, and every block comes back.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sized

from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.core.scheduling_policy import CheckedPolicy, SchedulingPolicy
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import ModelRunnerOutput, RowGroupOutput, SampledToken
from minivllm.sampling_params import SamplingParams

MAX_WAIT_STEPS = 50     # bounded wait: steps a request may wait while more urgent ones keep arriving
ARRIVAL_STEPS = 300     # urgent arrivals in the bounded-wait scenario: far past the bound
MAX_STATE_ENTRIES = 16  # entries the policy may still hold once (nearly) every request has finished


class Assignment(enum.Enum):
    """Which capstone assignment is graded: the priority rules (1-3) apply to aging only."""

    AGING = "aging"
    FAIR_SHARE = "fair-share"


class PolicyBehaviourError(AssertionError):
    """A policy kept the seam's contract but scheduled badly (the rule is in the message)."""


class _Run:
    """A scheduler under the policy, stepped without a model; records when each request first ran."""

    def __init__(self, policy: SchedulingPolicy, *, max_num_seqs: int, num_blocks: int, block_size: int = 4,
                 budget: int = 64) -> None:
        self.name = type(policy).__name__
        self.sched = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=budget, max_model_len=256, policy=CheckedPolicy(policy))
        self.step_no, self.count = 0, 0
        self.arrived: dict[str, int] = {}
        self.started: dict[str, int] = {}

    def add(self, prompt_len: int, max_tokens: int, priority: int) -> Sequence:
        seq = Sequence(f"r{self.count}", [5 + (self.count + i) % 90 for i in range(prompt_len)],
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_index=self.count,
                       priority=priority)
        self.count += 1
        self.arrived[seq.request_id] = self.step_no
        self.sched.add_sequence(seq)
        return seq

    def step(self) -> list[Sequence]:
        """One step; returns the preempted requests."""
        out = self.sched.schedule()
        for s in out.scheduled:
            self.started.setdefault(s.seq.request_id, self.step_no)
        rows = [RowGroupOutput([SampledToken(7)]) if s.samples else RowGroupOutput() for s in out.scheduled]
        self.sched.update_from_output(out, ModelRunnerOutput(rows))
        self.step_no += 1
        return out.preempted

    def drain(self, most: int = 3000) -> None:
        for _ in range(most):
            if self.sched.is_finished():
                self.step()  # one more call on an empty queue: the policy may prune here too
                return
            self.step()
        raise _fail(self.name, "every request finishes once arrivals stop (the scheduler drains)",
                    f"{len(self.sched.live_sequences)} still live after {most} steps")


def _fail(name: str, rule: str, seen: str) -> PolicyBehaviourError:
    return PolicyBehaviourError(f"{name} broke a RULE: {rule}; {seen}")


def check_priority_order(make_policy: Callable[[], SchedulingPolicy]) -> None:
    """Rule 1: one seat, a less urgent request that arrived first: the more urgent one is admitted."""
    run = _Run(make_policy(), max_num_seqs=1, num_blocks=32)
    low = run.add(prompt_len=2, max_tokens=2, priority=1)
    urgent = run.add(prompt_len=9, max_tokens=2, priority=-1)
    run.step()
    if urgent.request_id not in run.started:
        raise _fail(run.name,
                    "a more urgent request (lower `priority`) is admitted before a less urgent one that waits with it",
                    f"one seat, {low.request_id} (priority 1, 2-token prompt, arrived first) and {urgent.request_id} "
                    f"(priority -1, 9-token prompt): your policy admitted {sorted(run.started)}")


def check_victim(make_policy: Callable[[], SchedulingPolicy]) -> None:
    """Rule 2: the pool runs out beside a more and a less urgent request: the less urgent is preempted."""
    run = _Run(make_policy(), max_num_seqs=2, num_blocks=2)  # two 4-token prompts fill the pool exactly
    urgent = run.add(prompt_len=4, max_tokens=3, priority=-1)
    low = run.add(prompt_len=4, max_tokens=3, priority=1)
    run.step()  # both admitted; each now needs a second block for its first decode
    preempted = [s.request_id for s in run.step()]
    if preempted != [low.request_id]:
        raise _fail(run.name,
                    "under memory pressure the least urgent running request is preempted, not a more urgent one",
                    f"running {urgent.request_id} (priority -1) and {low.request_id} (priority 1), no free block: "
                    f"your policy preempted {preempted}")


def check_bounded_wait(policy: SchedulingPolicy) -> None:
    """Rule 3: the issue's scenario (module docstring); the request's first step must be within the bound."""
    run = _Run(policy, max_num_seqs=2, num_blocks=512)
    run.add(prompt_len=3, max_tokens=4, priority=0)
    run.add(prompt_len=3, max_tokens=4, priority=0)
    long = run.add(prompt_len=40, max_tokens=8, priority=2)
    for _ in range(ARRIVAL_STEPS):
        run.step()
        run.add(prompt_len=2, max_tokens=2, priority=0)
    run.drain()
    waited = run.started[long.request_id]
    if waited > MAX_WAIT_STEPS:
        raise _fail(type(policy).__name__,
                    f"a waiting request grows more urgent the longer it waits, so a stream of urgent arrivals cannot "
                    f"keep it out: it starts within {MAX_WAIT_STEPS} steps",
                    f"two seats, {long.request_id} (priority 2) beside one priority-0 arrival per step: it first ran "
                    f"at step {waited}" + (" (after the arrivals stopped)" if waited >= ARRIVAL_STEPS else ""))


def check_state_pruned(policy: SchedulingPolicy, num_finished: int) -> None:
    """Rule 4: no container attribute of the policy (one level deep) outgrows `MAX_STATE_ENTRIES`."""
    sizes = {k: len(v) for k, v in vars(policy).items() if isinstance(v, Sized) and not isinstance(v, (str, bytes))}
    big = {k: n for k, n in sizes.items() if n > MAX_STATE_ENTRIES}
    if big:
        raise _fail(type(policy).__name__,
                    "state kept per request is dropped once the request is no longer waiting (the policy lives as "
                    "long as the engine: state that only grows is a memory leak)",
                    f"after {num_finished} requests finished your policy still holds " +
                    ", ".join(f"{n} entries in self.{k}" for k, n in big.items()))


def check_open_load(policy: SchedulingPolicy, seed: int = 0, steps: int = 200) -> int:
    """Rule 5: one random arrival per step under memory pressure; returns the requests run."""
    rng = random.Random(seed)
    run = _Run(policy, max_num_seqs=4, num_blocks=12, budget=16)
    for _ in range(steps):
        run.add(prompt_len=rng.randint(1, 12), max_tokens=rng.randint(1, 6), priority=rng.randint(-2, 2))
        run.step()
    run.drain()
    worst = max(run.arrived, key=lambda r: run.started.get(r, 10**9) - run.arrived[r])
    wait = run.started.get(worst, 10**9) - run.arrived[worst]
    if wait > MAX_WAIT_STEPS:
        raise _fail(type(policy).__name__, f"under an open stream of arrivals every request starts within "
                    f"{MAX_WAIT_STEPS} steps of arriving",
                    f"{worst} waited {wait} steps")
    bm = run.sched.block_manager
    if bm.num_free_blocks != bm.num_blocks:
        raise _fail(run.name, "every block comes back once every request has finished",
                    f"{bm.num_blocks - bm.num_free_blocks} of {bm.num_blocks} are still held")
    return run.count


def check_policy_behaviour(make_policy: Callable[[], SchedulingPolicy],
                           assignment: Assignment = Assignment.AGING) -> None:
    """Run the behaviour checks in order (see the module docstring); raise `PolicyBehaviourError`
    naming the first rule broken."""
    if assignment is Assignment.AGING:
        check_priority_order(make_policy)
        check_victim(make_policy)
        policy = make_policy()
        check_bounded_wait(policy)
        check_state_pruned(policy, ARRIVAL_STEPS + 3)
    policy = make_policy()
    check_state_pruned(policy, check_open_load(policy))
