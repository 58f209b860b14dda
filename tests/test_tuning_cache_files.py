"""Tuning-cache files a start cannot use (cpu/tuning_cache.py, cpu/tuner.py): each is ignored with one
warning, measured again and rewritten, so the next start reads it back. Each of these once stopped
every start until the file was deleted (or, for the choices that parse, was replayed as if valid).

Each test has its own cache folder (conftest.py's `own_tuning_cache`)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable

import pytest
import torch

from minivllm.cpu import tuner
from minivllm.cpu.matmul_forms import MatmulForm
from minivllm.cpu.matmul_plan import PREFILL_BUCKET, MatmulPlan
from minivllm.cpu.tuning_cache import MAX_FILE_BYTES, TuningCache


def fast_b(name: str) -> None:  # a probe where candidate "b" is clearly faster than the default "a"
    sum(range(20000 if name == "a" else 10))


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "tuning cache" in r.getMessage()]


def assert_measured_again_and_rewritten(choose: Callable[[], str], caplog) -> None:
    """`choose` runs a chooser and returns its source: measured now, with one warning naming the file,
    then read back from the rewritten file."""
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        assert choose() == "measured"
    [warning] = cache_warnings(caplog)
    assert str(TuningCache().path) in warning
    caplog.clear()
    assert choose() == "cached" and not cache_warnings(caplog)


def toy() -> str:
    return tuner.choose("toy", ("a", "b"), lambda: [fast_b], "cached").source


def write(content: str | bytes) -> None:
    path = TuningCache().path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


def test_a_file_that_is_not_utf8(caplog):
    write(b'{"format": 1, "entries": {"toy": {"": {"chosen": "\xff\xfe"}}}}')
    assert_measured_again_and_rewritten(toy, caplog)


def test_a_file_nested_too_deep_for_the_parser(caplog):
    write("[" * 100_000 + "]" * 100_000)
    assert_measured_again_and_rewritten(toy, caplog)


def test_a_fifo_is_never_waited_on(caplog):
    """A FIFO at the file's path: opening it to read would wait for a writer, at every start."""
    path = TuningCache().path
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    assert_measured_again_and_rewritten(toy, caplog)  # the rewrite replaces it with a regular file


def test_a_file_over_the_size_cap(caplog):
    """A well-formed file padded past the cap: never read whole (a link to /dev/zero would be endless)."""
    write(json.dumps({"format": 1, "entries": {}}) + " " * MAX_FILE_BYTES)
    assert_measured_again_and_rewritten(toy, caplog)


def test_a_symbolic_link_is_not_followed(tmp_path, caplog):
    """A link to a well-formed file elsewhere (it could as well be /dev/zero): never read through."""
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"format": 1, "entries": {}}))
    path = TuningCache().path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    assert_measured_again_and_rewritten(toy, caplog)
    assert json.loads(target.read_text())["entries"] == {}  # the rewrite replaced the link, not its target


def test_a_choice_that_is_not_a_candidate(caplog):
    write(json.dumps({"format": 1, "entries": {"toy": {"": {"chosen": "c", "speedups": {"b": 2.0}}}}}))
    assert_measured_again_and_rewritten(toy, caplog)
    assert tuner.choose("toy", ("a", "b"), lambda: [fast_b], "cached").chosen == "b"


def test_speedups_over_other_candidates_than_the_choosers(caplog):
    write(json.dumps({"format": 1, "entries": {"toy": {"": {"chosen": "a", "speedups": {"z": 0.5}}}}}))
    assert_measured_again_and_rewritten(toy, caplog)


def test_an_unreadable_entry_leaves_the_others_in_place(caplog):
    other = {"": {"chosen": "b", "speedups": {"b": 3.0}}}
    write(json.dumps({"format": 1, "entries": {"toy": {"": {"chosen": "b", "speedups": {"b": "fast"}}},
                                               "other": other}}))
    assert_measured_again_and_rewritten(toy, caplog)
    assert json.loads(TuningCache().path.read_text())["entries"]["other"] == other


# The matmul plan reads many decisions from one entry, by name: a tiny fp32 "model" timed as if it streamed.
def plan_source() -> str:
    plan = MatmulPlan()
    plan.measure(WEIGHTS, repeats=1, cache_bytes=0)
    assert all(isinstance(form, MatmulForm) for form in plan.forms.values())
    assert all(0 < s < math.inf for s in plan.speedups.values())
    assert all(plan.forms[k] in (MatmulForm.LINEAR, MatmulForm.PACKED) for k in plan.forms if k.bucket == PREFILL_BUCKET)
    return plan.source


WEIGHTS = [torch.randn(96, 64) for _ in range(4)]


def edit_plan_entry(edit: Callable[[dict], None]) -> None:
    """Measure the plan once, then change its saved entry with `edit` (given the entry's decisions by name)."""
    assert plan_source() == "measured"
    path = TuningCache().path
    data = json.loads(path.read_text())
    [entry] = [name for name in data["entries"] if name.startswith("matmul")]
    edit(data["entries"][entry])
    path.write_text(json.dumps(data))


def first(decisions: dict) -> dict:
    return next(iter(decisions.values()))


@pytest.mark.parametrize("edit", [
    pytest.param(lambda d: first(d).update(chosen="fastest"), id="chosen_not_a_form"),
    pytest.param(lambda d: first(d).update(speedups={}), id="empty_speedups"),
    pytest.param(lambda d: first(d).update(speedups={"(W x^T)^T": 1.2, "bogus": 3.0}), id="other_speedup_names"),
    pytest.param(lambda d: d.update({"96 x 64 float32 rows 0": d.pop(next(iter(d)))}), id="a_name_the_plan_has_not"),
    pytest.param(lambda d: [c.update(chosen=MatmulForm.SKINNY.value) for n, c in d.items() if "rows 65-512" in n],
                 id="chosen_a_form_not_timed_there"),
    pytest.param(lambda d: first(d)["speedups"].update({"(W x^T)^T": math.nan}), id="nan_speedup"),
    pytest.param(lambda d: first(d)["speedups"].update({"(W x^T)^T": True}), id="bool_speedup"),
    pytest.param(lambda d: first(d)["speedups"].update({"(W x^T)^T": -2.0}), id="negative_speedup"),
    pytest.param(lambda d: first(d)["speedups"].update({"(W x^T)^T": "2.0"}), id="string_speedup"),
])
def test_a_plan_entry_the_plan_cannot_use(edit, caplog):
    edit_plan_entry(edit)
    assert_measured_again_and_rewritten(plan_source, caplog)


def test_the_lock_is_never_taken_through_a_symlink(tmp_path, caplog):
    """A link planted at the lock's path (dangling, to a file the user may write) must not create its target:
    the write fails, the start measures anyway and says why."""
    path = TuningCache().path
    path.parent.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "elsewhere" / "planted"
    target.parent.mkdir()
    path.with_suffix(".lock").symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        assert tuner.choose("toy", ("a", "b"), lambda: [fast_b], "cached").chosen == "b"
    assert not target.exists() and not path.exists()
    assert any("cannot write the tuning cache" in message for message in cache_warnings(caplog))
