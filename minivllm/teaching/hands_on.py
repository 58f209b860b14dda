"""The hands-on track: the assignments, what a student's file must define for each, and how it is loaded.

In the hands-on track a student writes a part the engine RUNS, plugged in through the engine's own seams,
and graded by the engine's own checks (docs/hands-on.md):

    assignment   the student's file defines               plugged in as                      graded by
    attention    an `AttentionBackend` subclass          LLM(attention_backend=...)         hands_on_attention.py
    kernel       a function `paged_attention(...)`       the same seam (`KernelBackend`)    hands_on_attention.py
    filter       a `SamplingFilter` subclass             LLM(sampling_filter=...)           hands_on_sampling.py
    allocator    a `BlockAllocator` subclass             LLM(block_allocator=...)           hands_on_allocator.py
    policy       a `SchedulingPolicy` subclass           LLM(scheduling_policy=...)         capstone.py

The starters are in exercises/hands_on/; the grader is `python -m minivllm.teaching.grade_hands_on`.
A student's file is loaded from its path as a module of its own (it need not be on `sys.path`), and
must define exactly one class of the seam's type (or, for the kernel, the function) — a helper class
of another type beside it is fine. It may not use the engine's own implementation of its part
(teaching/submission_rules.py: checked in its source before it runs, in its classes' MRO after, and in
the calls it makes while graded).
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import inspect
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from minivllm.teaching.submission_rules import RULES, AssignmentError, check_classes, check_source


class Assignment(enum.Enum):
    """The track's steps, in the order a course takes them."""

    ATTENTION = "attention"
    KERNEL = "kernel"
    FILTER = "filter"
    ALLOCATOR = "allocator"
    POLICY = "policy"


def check_finished(who: str, outputs: list) -> None:
    """Raise `AssignmentError` with the engine's message if a request failed (the engine fails only the
    request whose step raised, and says why in `RequestOutput.error`)."""
    for out in outputs:
        if out.error:
            raise AssignmentError(f"{who}: the engine failed request {out.request_id} because your code raised:\n  "
                                  f"{out.error}")


@functools.cache
def tiny_model(family: str) -> str:
    """A tiny random checkpoint of `family` in a temporary folder, built once per process (the graders share it)."""
    from minivllm.teaching.checkpoints import make_tiny_model

    return str(make_tiny_model(tempfile.mkdtemp(prefix=f"hands_on_{family}_"), family))


KERNEL_FUNCTION = "paged_attention"  # what the kernel assignment's file defines


def seam_class(assignment: Assignment) -> type:
    """The engine's base class a student's file subclasses for `assignment` (not the kernel: a function)."""
    if assignment is Assignment.ATTENTION:
        from minivllm.layers.attention_interface import AttentionBackend

        return AttentionBackend
    if assignment is Assignment.FILTER:
        from minivllm.layers.sampler import SamplingFilter

        return SamplingFilter
    if assignment is Assignment.ALLOCATOR:
        from minivllm.engine.core.block_allocator import BlockAllocator

        return BlockAllocator
    if assignment is Assignment.POLICY:
        from minivllm.engine.core.scheduling_policy import SchedulingPolicy

        return SchedulingPolicy
    raise ValueError(f"the {assignment.value} assignment defines a function, {KERNEL_FUNCTION}, not a class")


def load_student(path: str | Path, assignment: Assignment) -> type | Callable:
    """The class (or, for the kernel, the `paged_attention` function) that the file at `path` defines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (the starters are in exercises/hands_on/)")
    rules = RULES[assignment.value]
    check_source(path, rules)  # before it runs: no import of the engine's own implementation of the part
    name = f"hands_on_{assignment.value}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    spec.loader.exec_module(module)
    check_classes(module, rules)  # nor a class built on it
    if assignment is Assignment.KERNEL:
        fn = getattr(module, KERNEL_FUNCTION, None)
        if not callable(fn):
            raise AssignmentError(f"{path}: define a function `{KERNEL_FUNCTION}(q, k_cache, v_cache, block_tables, "
                                  "cu_seqlens_q, context_lens, scale)` (the starter has its signature)")
        return fn
    base = seam_class(assignment)
    found = [c for c in vars(module).values()
             if inspect.isclass(c) and issubclass(c, base) and c.__module__ == name and not inspect.isabstract(c)]
    if len(found) != 1:
        raise AssignmentError(f"{path}: define exactly one {base.__name__} subclass with every method written "
                              f"(found {[c.__name__ for c in found]})")
    return found[0]
