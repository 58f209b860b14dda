"""`WatchedPolicy`: the capstone grader's view of each call a policy gets: it may read the requests, never change them.

A policy sees the scheduler's own `Sequence` objects and its own waiting queue. Nothing in Python stops
it from writing into them, and a write "works": `seq.priority -= 1` in `admission_order` is an aging
policy in one line, and it passes every behaviour check. But the field is the caller's (vLLM's
`priority` is what the user asked for, reported back, compared by other policies, kept across a
preemption), and the step's transaction (engine/request/journal.py) keeps such a write once the step
commits: a policy that changes a request changes WHAT the engine runs, not only WHEN. So the rule is:
a policy reads the requests and the queue it is given and never changes them; what it needs to
remember it keeps in its own state.

`WatchedPolicy` enforces it the plain way: before each call it snapshots every field of every request
it passes (lists and token arrays copied, other objects by identity) and the order of the queue;
after the call it compares, and raises `RequestChangedError` naming the field, the request, the old and
the new value. It is a `CheckedPolicy` (engine/core/scheduling_policy.py), so the seam's contract is
checked too, naming the student's class, and the engine does not wrap it a second time. Each call also
runs under the submission rule's `Watch` (teaching/submission_watch.py, teaching/capstone_cheats.py): a
call into the engine's own policies, however it was reached, fails naming the rule (unless the policy
watched IS one of them: the behaviour checks also run FCFS and priority, to show what they miss).
It also keeps each `choose_victim` call's candidates and answer (`victim_calls`) for graders that
judge WHOM a policy preempted over a whole run (fair share: teaching/capstone_fair_share.py).
The scheduler asks `admission_order` in every step that admits, with the queue as it is, empty too (the
step after the last admission, the drain): a policy that raises there (`min()` of an empty queue) fails
with that rule named (`PolicyContractError`), not with its traceback.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any, NamedTuple

from minivllm.engine.core.scheduling_policy import CheckedPolicy, PolicyContractError, SchedulingPolicy
from minivllm.engine.request.sequence import Sequence
from minivllm.teaching.capstone_cheats import POLICY_RULES, is_engine_policy
from minivllm.teaching.submission_watch import Watch

_MISSING = "<not set>"
RULE = ("a policy reads the requests and the queue it is given and never changes them "
        "(keep what you need in your own state)")
EMPTY_RULE = ("admission_order is asked every step that admits, also with an empty waiting queue (then it "
              "returns [], and may prune its state as on any call)")


class RequestChangedError(AssertionError):
    """A policy wrote into a request or into the queue it was given (the field is in the message)."""


class VictimCall(NamedTuple):
    candidates: tuple[Sequence, ...]  # as the scheduler offered them: candidates[0] needs the block
    victim: Sequence
    running: tuple[Sequence, ...]  # every running request at the call (those scheduled earlier too); () if unknown


def _frozen(value: Any) -> Any:
    """A value to compare after the call: containers by their contents (copied now), the rest by identity
    (an object a policy replaced is a change; numbers, strings and enums compare by value)."""
    if isinstance(value, array):
        return ("array", value.typecode, value.tobytes())
    if isinstance(value, (list, tuple)):
        return ("items", tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(value))
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return ("object", id(value))


def _fields(seq: Sequence) -> dict[str, Any]:
    return {name: _frozen(v) for name, v in vars(seq).items() if name != "journal"}


def _shown(value: Any) -> str:
    if value is _MISSING:
        return value
    if isinstance(value, tuple) and value and value[0] in ("array", "items", "dict", "set", "object"):
        return {"array": "an array", "items": "a list", "dict": "a dict", "set": "a set",
                "object": "an object"}[value[0]]
    return repr(value)


class WatchedPolicy(CheckedPolicy):
    """The student's policy (`.inner`), its contract checked (`CheckedPolicy`) and every request it is
    given snapshotted around each call (module docstring)."""

    def __init__(self, inner: SchedulingPolicy, running: Callable[[], SequenceABC[Sequence]] | None = None) -> None:
        super().__init__(inner)
        self.victim_calls: list[VictimCall] = []
        self.running = running  # the scheduler's running queue, read when a victim is chosen (None: not kept)
        self.rules = None if is_engine_policy(type(inner)) else POLICY_RULES  # what the calls may not reach

    def admission_order(self, waiting: SequenceABC[Sequence]) -> list[Sequence]:
        before = self._snapshot(waiting)
        with self._watch() as watch:
            try:
                order = super().admission_order(waiting)
            except (AssertionError, NotImplementedError):
                raise
            except Exception as error:  # a policy that only ever saw a queue with requests in it
                if len(waiting):
                    raise
                raise PolicyContractError(f"{type(self.inner).__name__} broke a RULE: {EMPTY_RULE}; it raised "
                                          f"{type(error).__name__}: {error}") from error
        self._check(watch)
        self._compare("admission_order", waiting, before)
        return order

    def choose_victim(self, candidates: SequenceABC[Sequence]) -> Sequence:
        before = self._snapshot(candidates)
        with self._watch() as watch:
            victim = super().choose_victim(candidates)
        self._check(watch)
        self._compare("choose_victim", candidates, before)
        running = tuple(self.running()) if self.running is not None else ()
        self.victim_calls.append(VictimCall(tuple(candidates), victim, running))
        return victim

    def _watch(self) -> contextlib.AbstractContextManager[Watch | None]:
        return Watch(self.rules) if self.rules is not None else contextlib.nullcontext()

    def _check(self, watch: Watch | None) -> None:
        if watch is not None:
            watch.check(type(self.inner).__name__)

    @staticmethod
    def _snapshot(seqs: SequenceABC[Sequence]) -> tuple[list[int], list[tuple[Sequence, dict[str, Any]]]]:
        items = list(seqs)
        return [id(s) for s in items], [(s, _fields(s)) for s in items]

    def _compare(self, call: str, seqs: SequenceABC[Sequence], before: tuple[list, list]) -> None:
        queue_ids, fields = before
        name = type(self.inner).__name__
        if [id(s) for s in seqs] != queue_ids:
            what = "the waiting queue" if call == "admission_order" else "the candidates"
            raise RequestChangedError(
                f"{name} broke a RULE: {RULE}; {call} changed {what} it was given (added, removed or reordered "
                f"in place: return a new list, e.g. sorted(waiting, key=...), and leave the argument alone)")
        for seq, old in fields:
            new = _fields(seq)
            for field in sorted(old.keys() | new.keys()):
                was, now = old.get(field, _MISSING), new.get(field, _MISSING)
                if was != now:
                    raise RequestChangedError(
                        f"{name} broke a RULE: {RULE}; {call} changed `{field}` of request "
                        f"{seq.request_id!r} from {_shown(was)} to {_shown(now)}")
