"""The scheduling policies the engine ships, and the check it wraps a policy of your own in.

The interface, `SchedulingPolicy`, lives below the engine in minivllm/seams.py (the config checks a
policy's type without importing the engine); it is imported here, so `from
minivllm.engine.core.scheduling_policy import SchedulingPolicy` works as before. It asks two things:

    admission_order(waiting)    in which order to TRY to admit waiting requests this step
    choose_victim(candidates)   which running request to preempt when the pool is out of blocks

Everything else stays in `Scheduler` and holds for any policy (the seam's docstring lists it).
`FCFSPolicy` is the default (vLLM's "fcfs"): arrival order, and the newest admitted request is preempted
so the oldest always progresses. `PriorityPolicy` (vLLM's "priority"): a lower `priority` value first,
ties by arrival; the victim is the least urgent. Write your own by subclassing (see the capstone in
docs/teachers.md). A policy of your own is wrapped in `CheckedPolicy`, which refuses
(`PolicyContractError`, naming the rule) an admission order that drops, adds or repeats a request, and a
victim that is not one of the candidates.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from minivllm.engine.request.sequence import Sequence
from minivllm.seams import POLICY_NAMES, SchedulingPolicy, check_policy

# SchedulingPolicy is re-exported: the path tests, exercises and notebooks import it by.
__all__ = ["CheckedPolicy", "FCFSPolicy", "PolicyContractError", "PriorityPolicy", "SchedulingPolicy", "get_policy"]


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


class PolicyContractError(AssertionError):
    """A policy returned something the scheduler cannot use (the rule is in the message)."""


class CheckedPolicy(SchedulingPolicy):
    """Wraps a policy and enforces the seam's contract on every call, naming the policy and the rule it breaks.
    The engine wraps every policy of your own in it (`get_policy`; the built-in ones keep the contract): a
    policy that dropped a waiting request would leave it in its request forever, run by nobody; one that
    chose a request scheduled earlier in the step would corrupt the plan. The wrapped policy is `.inner`."""

    def __init__(self, inner: SchedulingPolicy) -> None:
        self.inner, self.name = inner, inner.name

    def admission_order(self, waiting: SequenceABC[Sequence]) -> list[Sequence]:
        order = list(self.inner.admission_order(waiting))
        if len(order) != len(waiting) or {id(s) for s in order} != {id(s) for s in waiting}:  # O(waiting)
            raise PolicyContractError(
                f"{type(self.inner).__name__} broke a RULE: admission_order must return every waiting request exactly once (a reordering: none "
                f"dropped, none added, none twice); got {_ids(order)} for waiting {_ids(waiting)}")
        return order

    def choose_victim(self, candidates: SequenceABC[Sequence]) -> Sequence:
        victim = self.inner.choose_victim(candidates)
        if not any(victim is c for c in candidates):
            raise PolicyContractError(
                f"{type(self.inner).__name__} broke a RULE: choose_victim must return one of `candidates` (the request that needs a block or "
                "one scheduled after it: a request already scheduled in this step cannot be preempted); got "
                f"{getattr(victim, 'request_id', victim)!r} for candidates {_ids(candidates)}")
        return victim


def _ids(seqs: SequenceABC[Sequence], most: int = 12) -> str:
    ids = [getattr(s, "request_id", s) for s in list(seqs)[:most + 1]]
    return str(ids[:most])[:-1] + ", ...]" if len(ids) > most else str(ids)


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}
# The config checks names against seams.POLICY_NAMES (it cannot import this module): the two must agree.
assert tuple(POLICIES) == POLICY_NAMES, f"seams.POLICY_NAMES {POLICY_NAMES} is not {tuple(POLICIES)}"


def get_policy(policy: str | SchedulingPolicy) -> SchedulingPolicy:
    """The scheduler's policy: a built-in one by its name; one of your own, wrapped in `CheckedPolicy`."""
    check_policy(policy)  # raises, naming the choices
    if isinstance(policy, SchedulingPolicy):
        return policy if isinstance(policy, CheckedPolicy) else CheckedPolicy(policy)
    return POLICIES[policy]()
