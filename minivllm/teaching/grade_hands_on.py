"""Grade a hands-on assignment: the student's part, plugged into the engine through its seam.

    python -m minivllm.teaching.grade_hands_on attention exercises/hands_on/1_attention/my_attention.py
    python -m minivllm.teaching.grade_hands_on kernel    exercises/hands_on/2_kernel/my_kernel.py
    python -m minivllm.teaching.grade_hands_on filter    exercises/hands_on/3_filter/my_filter.py
    python -m minivllm.teaching.grade_hands_on allocator exercises/hands_on/4_allocator/my_allocator.py
    python -m minivllm.teaching.grade_hands_on policy    exercises/capstone/my_policy.py
    (add --no-engine for the quick checks only, without the engine run)

A file that imports, calls or subclasses the engine's own implementation of its part is refused first,
naming the rule (teaching/submission_rules.py); a kernel must launch a @triton.jit function of its own.
Each assignment is graded in two parts, each printing ✓ or stopping at the first rule broken:
  1. the rules, one at a time, on small inputs against the engine's own reference (`naive_paged_attention`,
     `TopKTopPMinP`, `LRUAllocator`), plus, for the allocator, the scheduler's state machine;
  2. the engine running the student's part on a tiny random model: HF-exact greedy tokens (and logprobs),
     or exactly the default engine's tokens / cache hits.
The policy is the capstone (teaching/capstone.py), graded as `exercises/capstone/grade.py` does.
Exit status: 0 passed, 1 a rule broken, 2 not written yet (a `NotImplementedError` from the starter).
On a machine without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set here).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from minivllm.teaching.hands_on import Assignment, load_student


def grade(assignment: Assignment, student: type | Callable, *, engine: bool = True) -> None:
    """Grade `student` (the class, or for the kernel the function, a student's file defines); raise
    `AssignmentError` (an AssertionError) naming the rule broken, or NotImplementedError if unwritten."""
    name = getattr(student, "__name__", "student")
    if assignment in (Assignment.ATTENTION, Assignment.KERNEL):
        from minivllm.teaching.hands_on_attention import (PROBES, check_backend_in_engine, check_backend_probes,
                                                          kernel_backend)

        from minivllm.teaching.submission_rules import RULES

        kernel = assignment is Assignment.KERNEL
        make = kernel_backend(student) if kernel else student
        check_backend_probes(make, check_store=not kernel, rules=RULES[assignment.value],
                             kernel_module=student.__module__ if kernel else None)
        probes = ", ".join(p.name for p in PROBES)
        print(f"✓ 1/2 {name}: {len(PROBES)} probes against naive_paged_attention ({probes})"
              + ("; it launches its own @triton.jit kernel" if kernel else ""))
        if engine:  # Triton's interpreter runs a kernel ~100x slower than torch: one model, fewer tokens
            families = ("llama", "qwen3") if assignment is Assignment.ATTENTION else ("qwen3",)
            check_backend_in_engine(make, families, max_tokens=8 if assignment is Assignment.ATTENTION else 4)
            print(f"✓ 2/2 {name}: in the engine, greedy tokens and logprobs equal HF's on tiny "
                  f"{' and '.join(families)} (chunked prefill, prefix-cache hits, decode)")
    elif assignment is Assignment.FILTER:
        from minivllm.teaching.hands_on_sampling import FILTER_PROBES, check_filter_in_engine, check_filter_probes

        check_filter_probes(student)
        print(f"✓ 1/2 {name}: {len(FILTER_PROBES)} probes and 100 random mixes against TopKTopPMinP")
        if engine:
            check_filter_in_engine(student)
            print(f"✓ 2/2 {name}: in the engine, seeded sampling draws the default filter's tokens")
    elif assignment is Assignment.ALLOCATOR:
        from minivllm.teaching.hands_on_allocator import (check_allocator_in_engine, check_allocator_machine,
                                                          check_allocator_trace)

        check_allocator_trace(student)
        check_allocator_machine(student)
        print(f"✓ 1/2 {name}: call traces equal LRUAllocator's; the scheduler's state machine holds (ownership, "
              "conservation, rollback, drain)")
        if engine:
            check_allocator_in_engine(student)
            print(f"✓ 2/2 {name}: in the engine, HF-exact tokens and the LRU's prefix-cache hits")
    else:
        from minivllm.teaching.capstone import grade_policy

        grade_policy(student, hf=engine)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("assignment", choices=[a.value for a in Assignment])
    p.add_argument("path", help="the student's file (the starters are in exercises/hands_on/)")
    p.add_argument("--no-engine", action="store_true", help="the quick checks only (part 1)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():  # before the student's file defines a kernel
        os.environ.setdefault("TRITON_INTERPRET", "1")
    assignment = Assignment(args.assignment)
    try:
        student = load_student(args.path, assignment)
        grade(assignment, student, engine=not args.no_engine)
    except NotImplementedError:
        print(f"{args.path} is not written yet: replace each `raise NotImplementedError` with your code")
        return 2
    except AssertionError as error:
        print(f"✗ {args.path} failed.\n{error}")
        return 1
    print(f"{args.path} passed the {assignment.value} assignment.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
