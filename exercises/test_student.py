"""`pytest exercises/`: each of your functions in student.py checked against the engine.
An exercise you have not done yet is reported as skipped, not failed."""

from __future__ import annotations

import pytest
import student

from minivllm.teaching.exercises import REFERENCES, check


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_exercise(name):
    fn = getattr(student, name)
    try:
        check(name, fn)
    except NotImplementedError:
        pytest.skip(f"{name} is not done yet")
