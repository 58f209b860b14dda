"""The capstone's submission rule: the policy is the student's own, not the engine's under another name.

    check_own_policy(MyPolicy)       # before grading: the class, its bases and the file it is defined in
    WatchedPolicy(MyPolicy())        # while grading: each call runs under a `Watch` (teaching/capstone_watch.py)

The engine ships two policies (engine/core/scheduling_policy.py): `FCFSPolicy` and `PriorityPolicy`.
A submission that subclasses `PriorityPolicy`, or keeps one and forwards to it (`return
self.inner.choose_victim(c)`), passes every check the engine's policy passes without the student
writing that part: the rubric forbids it, so the grader refuses it, naming the rule. The checks are the
hands-on track's (teaching/submission_rules.py, `RULES["policy"]`), in three layers that cover for
each other: the file's source (an import, attribute or string naming an engine policy, under any
alias), the class's MRO, and a trace of the calls the policy makes while it is graded (a name built at
run time). This module adds what only the capstone needs: the engine's own class handed in as it is
(`grade_policy(PriorityPolicy)`), and a class with no file (defined in a notebook), whose source is
skipped while the other two layers still hold.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

from minivllm.teaching.hands_on import AssignmentError
from minivllm.teaching.submission_rules import RULES, check_classes, check_source

POLICY_RULES = RULES["policy"]
ENGINE_MODULES = ("minivllm.engine", "minivllm.seams")  # where the engine's own policies are defined


def is_engine_policy(policy_class: type) -> bool:
    """One of the engine's own policies (graded as a comparison, never as a submission: `grade_policy` refuses it)."""
    return any(policy_class.__module__ == m or policy_class.__module__.startswith(m + ".") for m in ENGINE_MODULES)


def check_own_policy(policy_class: type) -> None:
    """The class and its file (module docstring); raises `AssignmentError` naming the rule and what was used."""
    name = policy_class.__name__
    module = policy_class.__module__
    if is_engine_policy(policy_class):
        raise AssignmentError(f"{name} broke a RULE: {POLICY_RULES.rule}.\n  {name} is the engine's own policy "
                              f"({module}): write a SchedulingPolicy subclass of your own")
    check_classes(SimpleNamespace(__name__=module, cls=policy_class), POLICY_RULES)  # only this class's MRO
    try:
        path = inspect.getsourcefile(policy_class)
    except (TypeError, OSError):  # a module not registered in sys.modules, or defined interactively
        path = getattr(sys.modules.get(module), "__file__", None)
    if path is not None and Path(path).is_file():
        check_source(path, POLICY_RULES)
