"""The capstone's submission rule: the policy is the student's own, not the engine's under another name.

    check_own_policy(MyPolicy)              # before grading: what the class is and what its file names
    with engine_policies_refused(name):     # while grading: a call that reaches the engine's policies fails
        ...

The engine ships two policies (engine/core/scheduling_policy.py): `FCFSPolicy` and `PriorityPolicy`.
A submission that subclasses `PriorityPolicy`, or keeps one and forwards to it (`return
self.inner.choose_victim(c)`), passes every behaviour check the engine's policy passes without the
student writing that part: the rubric forbids it, so the grader refuses it, naming the rule. Three
layers, each catching what the one before cannot:

  1. the class: no engine policy among its bases (`__mro__`); only the seam, `SchedulingPolicy`;
  2. its file: no import, name or attribute that is one of the engine's policies (or `get_policy`,
     `POLICIES`, `CheckedPolicy`, the ways to reach them by name), read from the source's syntax tree;
  3. while it is graded: the engine policies' two methods are swapped for ones that raise, so a call
     that got there anyway (a name built at run time) fails the same way.
Using the seam's own helpers (`SchedulingPolicy`) and any other module is fine.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path

from minivllm.engine.core import scheduling_policy as engine_policies
from minivllm.engine.core.scheduling_policy import FCFSPolicy, PriorityPolicy, SchedulingPolicy

RULE = ("the policy is your own: it may not import, call or subclass the engine's scheduling policies "
        "(FCFSPolicy, PriorityPolicy, get_policy, ...); subclass `SchedulingPolicy` and write both methods")
ENGINE_POLICIES = (FCFSPolicy, PriorityPolicy)
FORBIDDEN_NAMES = frozenset({"FCFSPolicy", "PriorityPolicy", "CheckedPolicy", "get_policy", "POLICIES"})


class SubmissionRuleError(AssertionError):
    """The submission uses the engine's own policy (what it used is in the message)."""


def _refuse(name: str, seen: str) -> SubmissionRuleError:
    return SubmissionRuleError(f"{name} broke a RULE: {RULE}; {seen}")


def forbidden_names(source: str) -> list[tuple[int, str]]:
    """(line, name) for each import, name or attribute in `source` that reaches an engine policy."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, a.name) for a in node.names if a.name in FORBIDDEN_NAMES]
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and node.value in FORBIDDEN_NAMES:
            found.append((node.lineno, repr(node.value)))  # getattr(module, "PriorityPolicy")
    return sorted(set(found))


def check_own_policy(policy_class: type) -> None:
    """Layers 1 and 2 (module docstring); raises `SubmissionRuleError` naming what was used."""
    name = policy_class.__name__
    if policy_class.__module__ == engine_policies.__name__:
        raise _refuse(name, f"{name} is the engine's own policy ({engine_policies.__name__})")
    for base in policy_class.__mro__[1:]:
        if base.__module__ == engine_policies.__name__ and base is not SchedulingPolicy:
            raise _refuse(name, f"{name} subclasses the engine's {base.__name__}")
    try:
        path = inspect.getsourcefile(policy_class)
    except (TypeError, OSError):  # a module not registered in sys.modules, or defined interactively
        path = None
    if path is None or not Path(path).exists():
        return  # defined interactively: layer 3 still holds
    uses = forbidden_names(Path(path).read_text())
    if uses:
        shown = ", ".join(f"{n} (line {line})" for line, n in uses)
        raise _refuse(name, f"{Path(path).name} uses {shown}")


@contextlib.contextmanager
def engine_policies_refused(name: str) -> Iterator[None]:
    """Layer 3 (module docstring): while open, calling an engine policy's method raises `SubmissionRuleError`."""
    saved = {(cls, m): cls.__dict__[m] for cls in ENGINE_POLICIES for m in ("admission_order", "choose_victim")}

    def refusing(cls: type, method: str):  # noqa: ANN202 -- a method that stands in for the engine's
        def refused(self: object, *args: object, **kwargs: object) -> object:
            raise _refuse(name, f"the graded policy called {cls.__name__}.{method} (the engine's own)")
        return refused

    for cls, method in saved:
        setattr(cls, method, refusing(cls, method))
    try:
        yield
    finally:
        for (cls, method), original in saved.items():
            setattr(cls, method, original)
