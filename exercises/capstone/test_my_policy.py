"""`pytest exercises/capstone`: grades my_policy.py (skipped until it is written). Same checks as
`python exercises/capstone/grade.py`."""

from __future__ import annotations

import pytest
from grade import HERE, load_policy

from minivllm.teaching.capstone import grade_policy


def test_my_policy():
    policy = load_policy(HERE / "my_policy.py")
    try:
        grade_policy(policy)
    except NotImplementedError:
        pytest.skip(f"{policy.__name__} is not written yet")
