"""The capstone's behaviour checks: what a scheduling policy DOES, not only the seam's contract.

    check_policy_behaviour(MyPolicy)                        # priority with aging (the default)
    check_policy_behaviour(MyPolicy, Assignment.FAIR_SHARE) # fair share: judged on tenants instead

A policy can keep the contract (every waiting request once, a victim among the candidates) and still
schedule badly: shortest-prompt-first ignores priorities, a policy that always preempts the requester
throws away the most urgent work, one that never forgets a finished request grows without bound. Each
check below runs a real `Scheduler` through one small scenario, stepped as the engine steps it (the
step's transaction, n > 1 requests as sibling sequences: teaching/capstone_run.py), with the policy
inside `WatchedPolicy` (teaching/capstone_watch.py: a policy that writes into a request, e.g. ages it
by lowering `seq.priority`, fails there, naming the field), and raises `PolicyBehaviourError` naming
the RULE and what was seen:

  1. priority order: two requests arrive together, one seat; the more urgent (lower `priority`) is
     admitted first even though it arrived second and its prompt is longer;
  2. the victim: two running requests, no free block; the least urgent one is preempted. Asked in both
     arrival orders (the urgent one first, then last), so "always the newest" and "always the one
     asking for the block" each fail one;
  3. bounded wait, to the finish (open-loop arrivals under memory pressure): `max_num_seqs=2`, a pool of
     `BOUNDED_POOL_BLOCKS` blocks (the long request alone needs 12 of them), two urgent requests
     queued, one long low-priority request, then one short urgent arrival per step for
     `ARRIVAL_STEPS` steps; run twice, at priorities 2 beside 0 and 0 beside -2 (a policy that ages
     only the level of one probe fails the other). Priority alone never runs the long one while
     arrivals go on; an aging policy must start it within `MAX_WAIT_STEPS` steps AND then finish it
     within `FINISH_SLACK` x the steps it needs alone (one prefill step and max_tokens - 1 decodes). Why that
     bound is fair: a request that waited long enough to start has aged past the newcomers; from then
     on they are less urgent, and preempting it for them throws away its wait and its work (the
     recompute starts from its prompt). An aging policy that forgets the age once the request runs,
     or at a preemption, makes it the victim again and again: started at step 10, it finishes at step
     32 here (the issue's example: started at 24, preempted three times, finished at 149 of 300).
     The slack (x2) leaves room for the preemptions the policy cannot avoid: when every other
     candidate was scheduled before it in the step, the request that needs the block is the only
     one to preempt. The scheduler's anti-starvation hold cannot help here: it stops admission
     BEHIND a starving request in the policy's order, it never moves it forward
     (docs/concepts/scheduling.md);
  4. the victim by age: a priority-1 request has run alone for `VICTIM_AGE_STEPS` steps when a fresh
     priority-0 one arrives; when the pool runs out under both, the fresh one is preempted. By the aged
     urgency the docstring asks for (priority - age / K, with any K that passes rule 3: K < 25) the old
     request is the more urgent; a victim rule on the raw `priority`, or an age lost once the request
     runs, preempts it and throws away 60 steps of work for a newcomer;
  5. stale state: after the scenarios (hundreds of requests finished), the policy's own containers
     (dicts, lists, sets held as attributes) hold at most `MAX_STATE_ENTRIES` entries: state kept per
     request must be dropped once the request has finished (`seq.is_finished`);
  6. open load: random arrivals every step with mixed priorities (some n > 1) under memory pressure
     (preemptions), enough that a policy without aging keeps a request out for over 60 steps; every
     request starts within `MAX_WAIT_STEPS` of arriving and finishes, and every block comes back.
For `Assignment.FAIR_SHARE`, rules 1-4 are replaced by the tenant rules (teaching/capstone_fair_share.py).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sized

from minivllm.engine.core.scheduling_policy import SchedulingPolicy
from minivllm.teaching.capstone_fair_share import check_fair_share
from minivllm.teaching.capstone_run import PolicyBehaviourError, ScenarioRun, fail

__all__ = ["Assignment", "PolicyBehaviourError", "check_policy_behaviour"]

MAX_WAIT_STEPS = 50     # bounded wait: steps a request may wait while more urgent ones keep arriving
FINISH_SLACK = 2        # bounded wait to the finish: once started, within 2 x the steps it needs alone
BOUNDED_POOL_BLOCKS = 12  # the bounded-wait scenario's pool: the long request's 48 tokens fill it
ARRIVAL_STEPS = 300     # urgent arrivals in the bounded-wait scenario: far past the bound
BOUNDED_WAIT_LEVELS = ((2, 0), (0, -2))  # (the long request's priority, the arrivals'): aging is not one level's
VICTIM_AGE_STEPS = 60   # the victim-by-age probe: how long the old request has run when the fresh one comes
MAX_STATE_ENTRIES = 16  # entries the policy may still hold once (nearly) every request has finished


class Assignment(enum.Enum):
    """Which capstone assignment is graded: aging (the priority rules) or fair share (the tenant rules)."""

    AGING = "aging"
    FAIR_SHARE = "fair-share"


def check_priority_order(make_policy: Callable[[], SchedulingPolicy]) -> None:
    """Rule 1: one seat, a less urgent request that arrived first: the more urgent one is admitted."""
    run = ScenarioRun(make_policy(), max_num_seqs=1, num_blocks=32)
    low = run.add(prompt_len=2, max_tokens=2, priority=1)
    urgent = run.add(prompt_len=9, max_tokens=2, priority=-1)
    run.step()
    if urgent.request_id not in run.started:
        raise fail(run.name,
                    "a more urgent request (lower `priority`) is admitted before a less urgent one that waits with it",
                    f"one seat, {low.request_id} (priority 1, 2-token prompt, arrived first) and {urgent.request_id} "
                    f"(priority -1, 9-token prompt): your policy admitted {sorted(run.started)}")


def check_victim(make_policy: Callable[[], SchedulingPolicy]) -> None:
    """Rule 2: the pool runs out beside a more and a less urgent request: the less urgent is preempted,
    whichever of the two arrived (and was admitted) first."""
    for priorities in ([-1, 1], [1, -1]):
        run = ScenarioRun(make_policy(), max_num_seqs=2, num_blocks=2)
        running, victim = run.first_victim(priorities)
        if victim.priority != 1:
            shown = ", ".join(f"{s.request_id} (priority {s.priority})" for s in running)
            raise fail(run.name,
                        "under memory pressure the least urgent running request is preempted, not a more urgent one",
                        f"running {shown} in admission order, no free block: your policy preempted "
                        f"{victim.request_id} (the {'newest' if victim is running[-1] else 'first admitted'})")


def check_bounded_wait(policy: SchedulingPolicy, low: int = 2, urgent: int = 0) -> None:
    """Rule 3: the issue's scenario under memory pressure (module docstring), the long request at priority
    `low` beside arrivals at `urgent`: it starts within the bound, then finishes within `FINISH_SLACK` x
    the steps it needs alone."""
    run = ScenarioRun(policy, max_num_seqs=2, num_blocks=BOUNDED_POOL_BLOCKS)
    run.add(prompt_len=3, max_tokens=4, priority=urgent)
    run.add(prompt_len=3, max_tokens=4, priority=urgent)
    long = run.add(prompt_len=40, max_tokens=8, priority=low)
    for _ in range(ARRIVAL_STEPS):
        run.step()
        run.add(prompt_len=2, max_tokens=2, priority=urgent)
    run.drain()
    rid = long.request_id
    started, finished = run.started[rid], run.finished[rid]
    if started > MAX_WAIT_STEPS:
        raise fail(run.name,
                    f"a waiting request grows more urgent the longer it waits, so a stream of urgent arrivals cannot "
                    f"keep it out: it starts within {MAX_WAIT_STEPS} steps",
                    f"two seats, {rid} (priority {low}) beside one arrival of priority {urgent} per step: it first ran "
                    f"at step {started}" + (" (after the arrivals stopped)" if started >= ARRIVAL_STEPS else ""))
    alone = 1 + long.sampling_params.max_tokens - 1  # one prefill step (40 tokens < the budget), then decodes
    if finished - started > FINISH_SLACK * alone:
        raise fail(run.name,
                    f"bounded wait holds to the finish: a request that aged enough to start keeps its age while it "
                    f"runs and across a preemption, so newer arrivals never take its blocks; it finishes within "
                    f"{FINISH_SLACK} x the {alone} steps it needs alone of its first start",
                    f"two seats, a {BOUNDED_POOL_BLOCKS}-block pool, one arrival of priority {urgent} per step: "
                    f"{run.history(rid)}")


def check_victim_by_age(make_policy: Callable[[], SchedulingPolicy]) -> None:
    """Rule 4: an old priority-1 request (running `VICTIM_AGE_STEPS` steps) and a fresh priority-0 one, the
    pool out of blocks under both: the fresh one is preempted (its aged urgency is the lower)."""
    run = ScenarioRun(make_policy(), max_num_seqs=2, num_blocks=17)  # the old one's 62 tokens hold 16 blocks
    old = run.add(prompt_len=2, max_tokens=80, priority=1)
    for _ in range(VICTIM_AGE_STEPS):
        run.step()
    fresh = run.add(prompt_len=1, max_tokens=8, priority=0)
    while not any(len(call.candidates) == 2 for call in run.watched.victim_calls):
        assert run.step_no < VICTIM_AGE_STEPS + 20, "the probe's pool runs out under both within a few steps"
        run.step()
    call, now = next(call for call in run.watched.victim_calls if len(call.candidates) == 2), run.step_no - 1
    if call.victim is not fresh:
        raise fail(run.name,
                    "the victim is chosen by the same aged urgency as the admission order, so an old request that "
                    "aged past a fresh one (priority - age / K, the age kept while it runs) is not preempted for it",
                    f"at step {now} {old.request_id} (priority 1) had been running since step 0, {fresh.request_id} "
                    f"(priority 0) arrived at step {VICTIM_AGE_STEPS}; the pool ran out under both: your policy "
                    f"preempted {call.victim.request_id}, the old one (a victim by raw `priority`, or an age lost "
                    "once the request runs)")


def check_state_pruned(policy: SchedulingPolicy, num_finished: int) -> None:
    """Rule 5: no container attribute of the policy (one level deep) outgrows `MAX_STATE_ENTRIES`."""
    sizes = {k: len(v) for k, v in vars(policy).items() if isinstance(v, Sized) and not isinstance(v, (str, bytes))}
    big = {k: n for k, n in sizes.items() if n > MAX_STATE_ENTRIES}
    if big:
        raise fail(type(policy).__name__,
                    "state kept per request is dropped once the request has finished (the policy lives as "
                    "long as the engine: state that only grows is a memory leak)",
                    f"after {num_finished} requests finished your policy still holds " +
                    ", ".join(f"{n} entries in self.{k}" for k, n in big.items()))


def check_open_load(policy: SchedulingPolicy, seed: int = 0, steps: int = 200) -> int:
    """Rule 6: one random arrival per step under memory pressure; returns the requests run."""
    rng = random.Random(seed)
    run = ScenarioRun(policy, max_num_seqs=4, num_blocks=12, budget=16)
    for _ in range(steps):
        n = rng.choice([1, 1, 1, 2])  # an n = 2 request: two sibling sequences, half the tokens each (same load)
        run.add(prompt_len=rng.randint(1, 12), max_tokens=rng.randint(1, 7 // n), priority=rng.randint(-2, 2), n=n)
        run.step()
    run.drain()
    worst = max(run.arrived, key=lambda r: run.started.get(r, 10**9) - run.arrived[r])
    wait = run.started.get(worst, 10**9) - run.arrived[worst]
    if wait > MAX_WAIT_STEPS:
        raise fail(type(policy).__name__, f"under an open stream of arrivals every request starts within "
                    f"{MAX_WAIT_STEPS} steps of arriving",
                    f"{worst} waited {wait} steps")
    bm = run.sched.block_manager
    if bm.num_free_blocks != bm.num_blocks:
        raise fail(run.name, "every block comes back once every request has finished",
                    f"{bm.num_blocks - bm.num_free_blocks} of {bm.num_blocks} are still held")
    return run.count


def check_policy_behaviour(make_policy: Callable[[], SchedulingPolicy],
                           assignment: Assignment = Assignment.AGING) -> None:
    """Run the behaviour checks in order (see the module docstring); raise `PolicyBehaviourError`
    naming the first rule broken."""
    if assignment is Assignment.FAIR_SHARE:
        check_fair_share(make_policy)
    else:
        check_priority_order(make_policy)
        check_victim(make_policy)
        policy = make_policy()
        for low, urgent in BOUNDED_WAIT_LEVELS:
            check_bounded_wait(policy, low, urgent)
        check_victim_by_age(make_policy)
        check_state_pruned(policy, len(BOUNDED_WAIT_LEVELS) * (ARRIVAL_STEPS + 3))
    policy = make_policy()
    check_state_pruned(policy, check_open_load(policy))
