"""`pytest exercises/hands_on`: grades each of your files (an assignment not started yet is skipped). The same
checks as `python -m minivllm.teaching.grade_hands_on <assignment> <file>`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the kernel runs in Triton's interpreter: chosen before it is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.teaching.grade_hands_on import grade  # noqa: E402
from minivllm.teaching.hands_on import Assignment, load_student  # noqa: E402

HERE = Path(__file__).resolve().parent
FILES = {Assignment.ATTENTION: HERE / "1_attention" / "my_attention.py",
         Assignment.KERNEL: HERE / "2_kernel" / "my_kernel.py",
         Assignment.FILTER: HERE / "3_filter" / "my_filter.py",
         Assignment.ALLOCATOR: HERE / "4_allocator" / "my_allocator.py"}


@pytest.mark.parametrize("assignment", list(FILES), ids=lambda a: a.value)
def test_assignment(assignment):
    try:
        grade(assignment, load_student(FILES[assignment], assignment))
    except NotImplementedError:
        pytest.skip(f"{FILES[assignment].name} is not written yet")
