"""The capstone: your own scheduling policy, behind the engine's policy seam.

Write ONE of these (or another idea your teacher agrees to):

  * priority with aging: like vLLM's "priority" policy (a lower `seq.priority` goes first), but a
    request's effective priority improves the longer it waits, so a stream of urgent requests can
    no longer keep a low-priority one waiting forever;
  * fair share: treat `seq.priority` as a tenant id; admit the request of the tenant that has been
    served least so far first, and preempt from the tenant that holds the most running requests.
    Count each sequence admitted (the n siblings of an n > 1 request are n admissions), and lift the
    count of a tenant that comes (back) to the lowest count of those that had work waiting: what a
    tenant got while it was alone is no debt.

Your policy may READ the requests and the queue it is given, never change them: no `seq.priority -= 1`,
no attribute of your own on a request, no `candidates.sort()`. Keep what you need in your own state.
Write both methods yourself: importing, calling or subclassing the engine's `FCFSPolicy` or
`PriorityPolicy` is refused by the grader (read them, do not reuse them).

The seam (`SchedulingPolicy`, minivllm/seams.py) asks your policy two questions in each step:

  admission_order(waiting)    every waiting request exactly once, most urgent first; asked in every
                              step that admits, also when `waiting` is empty: then return []
  choose_victim(candidates)   one of `candidates`: whom to preempt when the KV pool runs out

Everything else stays in the Scheduler and holds for any policy: the token budget, chunked
prefill, the anti-starvation hold, never preempting a request already scheduled in the step.
Read `FCFSPolicy` and `PriorityPolicy` first (minivllm/engine/core/scheduling_policy.py): each is four
lines. The hold only stops admission BEHIND a request that was passed over too often; it never
moves a request forward in your order. So if your order keeps a request at the back (a stream of
more urgent arrivals), it waits forever: bounded waiting is your policy's job.

What the grader checks beyond the contract (minivllm/teaching/policy_behaviour.py), with new
requests arriving while others run:
  * priority order: of two requests waiting together, the more urgent (lower priority) goes first;
  * the victim: under memory pressure the least urgent running request is preempted, whichever of
    them arrived first (asked both ways round);
  * bounded wait, to the finish: a priority-2 request beside one priority-0 arrival per step (and a
    priority-0 one beside priority -2), in a pool it fills alone, starts within 50 steps AND, once
    started, finishes within twice the steps it needs alone. So the age must survive the start: a
    request that aged its way in must not be chosen as the victim for the newcomers it overtook
    (choose the victim by the same aged urgency, and keep the age while it runs and across a
    preemption);
  * the victim by age: a priority-1 request that has run for 60 steps and a fresh priority-0 one
    beside it: when the pool runs out, the fresh one is preempted (the old one aged past it);
  * stale state: what you keep per request is dropped once the request has finished (your policy is
    never told: prune in `admission_order`, which is called every step, reading `seq.is_finished`);
  * open load: random arrivals, mixed priorities, memory pressure: each request starts within 50
    steps and finishes.
For fair share, add `--fair-share`: instead of the four priority rules, while two tenants both wait
each must get 40-60 % of the admissions (a sequence each, siblings too), in three runs: tenants sending
at 2 : 1 (the quieter one as n = 2 requests), one tenant sending only n = 2 requests, and a tenant alone
for 40 steps joined by a busier one; and each victim must belong to the tenant holding the most of the
candidates (or of the running requests).

What a `Sequence` (minivllm/engine/request/sequence.py) tells you: `request_id`, `priority`,
`arrival_index` (0, 1, 2, ... in arrival order; the n sequences of an n > 1 request share it and their
priority, each has its own `request_id`), `is_finished`, `num_tokens`, `num_output_tokens`,
`num_computed_tokens`, `num_admission_skips`, `status`. Your policy object lives as long as the
engine, so it may keep state of its own (e.g. how many steps each request has waited).

Grade it:   python exercises/capstone/grade.py exercises/capstone/my_policy.py [--fair-share]
            (or: pytest exercises/capstone, which grades the aging assignment)
Use it:     LLM(scheduling_policy=MyPolicy()).generate(prompts, params, priority=[...])
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from minivllm.engine.core.scheduling_policy import SchedulingPolicy
from minivllm.engine.request.sequence import Sequence


class MyPolicy(SchedulingPolicy):
    name = "my-policy"

    def __init__(self) -> None:
        # TODO: the state your policy keeps between steps, if any.
        pass

    def admission_order(self, waiting: SequenceABC[Sequence]) -> list[Sequence]:
        # TODO: every request of `waiting` exactly once, the one to try first at the front.
        # (`waiting` is in arrival order, with preempted requests in front. It may be empty: the
        # scheduler asks every step, so return [] then, e.g. no min() over it.)
        raise NotImplementedError

    def choose_victim(self, candidates: SequenceABC[Sequence]) -> Sequence:
        # TODO: one of `candidates`. candidates[0] is the running request that needs a block; the
        # others were admitted after it (the last one most recently). Preempting candidates[0]
        # itself is allowed: it then waits for the others to free blocks.
        raise NotImplementedError
