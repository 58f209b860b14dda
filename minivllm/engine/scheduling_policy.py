"""`SchedulingPolicy`: the two choices a scheduler makes that are a matter of policy, not of mechanics.

    admission_order(waiting)    in which order to TRY to admit waiting requests this step
    choose_victim(candidates)   which running request to preempt when the pool is out of blocks

Everything else stays in `Scheduler` and holds for any policy: the token budget, chunked prefill,
draft slots, state slots, skip-and-continue admission with its anti-starvation hold, and the rule
that a victim is never a request already scheduled in this step (the candidates are the request that
needs the block and the ones scheduled after it). `FCFSPolicy` is the default (vLLM's "fcfs"):
arrival order, and the newest admitted request is preempted so the oldest always progresses.
`PriorityPolicy` (vLLM's "priority"): a lower `priority` value first, ties by arrival; the victim is
the least urgent. Write your own by subclassing (see the capstone in docs/teachers.md).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence as SequenceABC

from minivllm.engine.sequence import Sequence


class SchedulingPolicy(abc.ABC):
    name = "custom"

    @abc.abstractmethod
    def admission_order(self, waiting: SequenceABC[Sequence]) -> list[Sequence]:
        """Every waiting request exactly once, most urgent first (the queue's order is arrival order,
        with preempted requests in front)."""

    @abc.abstractmethod
    def choose_victim(self, candidates: SequenceABC[Sequence]) -> Sequence:
        """One of `candidates` (running, in admission order; the last one was admitted last)."""


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def admission_order(self, waiting: SequenceABC[Sequence]) -> list[Sequence]:
        return list(waiting)

    def choose_victim(self, candidates: SequenceABC[Sequence]) -> Sequence:
        return candidates[-1]  # the newest: the oldest request always makes progress


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def admission_order(self, waiting: SequenceABC[Sequence]) -> list[Sequence]:
        return sorted(waiting, key=lambda s: (s.priority, s.arrival_index))

    def choose_victim(self, candidates: SequenceABC[Sequence]) -> Sequence:
        return max(candidates, key=lambda s: (s.priority, s.arrival_index))


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def get_policy(policy: str | SchedulingPolicy) -> SchedulingPolicy:
    if isinstance(policy, SchedulingPolicy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy={policy!r}: use one of {sorted(POLICIES)} or a SchedulingPolicy")
    return POLICIES[policy]()
