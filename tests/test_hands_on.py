"""The hands-on track's graders (teaching/grade_hands_on.py): each passes its reference solution
(tests/hands_on_solutions/) and fails mistakes students make, naming the rule broken.

A planted mistake is ONE edit of the reference's source, written to a file and graded from its path, as
a student's file is: the table below reads as a list of common mistakes and the rule each breaks. Each
edit's anchor must appear exactly once in the reference, so a change to a reference that moves an
anchor fails here instead of silently planting nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from minivllm.teaching.grade_hands_on import grade, main
from minivllm.teaching.hands_on import Assignment, AssignmentError, load_student
from minivllm.teaching.hands_on_allocator import check_allocator_in_engine, check_allocator_machine

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = Path(__file__).resolve().parent / "hands_on_solutions"
REFERENCE = {Assignment.ATTENTION: "attention.py", Assignment.KERNEL: "kernel.py",
             Assignment.FILTER: "sampling_filter.py", Assignment.ALLOCATOR: "allocator.py"}
STARTERS = {Assignment.ATTENTION: "exercises/hands_on/1_attention/my_attention.py",
            Assignment.KERNEL: "exercises/hands_on/2_kernel/my_kernel.py",
            Assignment.FILTER: "exercises/hands_on/3_filter/my_filter.py",
            Assignment.ALLOCATOR: "exercises/hands_on/4_allocator/my_allocator.py",
            Assignment.POLICY: "exercises/capstone/my_policy.py"}


def planted(tmp_path: Path, assignment: Assignment, old: str, new: str) -> Path:
    """The reference with `old` replaced by `new`, as a student's file."""
    source = (SOLUTIONS / REFERENCE[assignment]).read_text()
    assert source.count(old) == 1, f"the mistake's anchor {old!r} is not exactly once in {REFERENCE[assignment]}"
    path = tmp_path / REFERENCE[assignment]
    path.write_text(source.replace(old, new))
    return path


MISTAKES = [
    # (assignment, the edit, the rule the grader must name)
    (Assignment.ATTENTION, ("weights = scores.masked_fill(future, float(\"-inf\")).softmax(-1)",
                            "weights = scores.softmax(-1)"), "causal: the row at position p attends to keys 0 .. p"),
    (Assignment.ATTENTION, (":(ctx + bs - 1) // bs]", ":ctx // bs]"), "the last one partly filled"),
    (Assignment.ATTENTION, ("blocks = meta.block_tables[i, :(ctx + bs - 1) // bs].long()",
                            "blocks = torch.arange((ctx + bs - 1) // bs)"), "block_tables[i][p // block_size]"),
    (Assignment.ATTENTION, ("        k_pool[meta.slot_mapping] = k\n        v_pool[meta.slot_mapping] = v\n", ""),
     "forward stores each new row's k and v at its slot"),
    (Assignment.ATTENTION, ("positions = torch.arange(ctx - n, ctx)",
                            "positions = torch.arange(ctx - n, ctx) if n == 1 else torch.arange(n)"),
     "the LAST query_len positions of its context"),
    (Assignment.KERNEL, ("visible = k_pos <= pos", "visible = k_pos < ctx"), "causal: the row at position p"),
    (Assignment.KERNEL, ("range(0, pos // BLOCK_SIZE + 1)", "range(0, pos // BLOCK_SIZE)"),
     "over every key of the request's context"),
    (Assignment.KERNEL, ("block_tables.stride(0), NUM_HEADS", "0, NUM_HEADS"), "through its own row of block_tables"),
    (Assignment.KERNEL, ("kv_head = head // (NUM_HEADS // NUM_KV_HEADS)", "kv_head = head % NUM_KV_HEADS"),
     "query head h reads KV head h // (num_heads // num_kv_heads)"),
    (Assignment.FILTER, ("ranked, order = row.sort(", "ranked, order = logits[r].sort("),
     "top-p measures the mass of the tokens top-k kept, renormalised"),
    (Assignment.FILTER, ("mass_above = probs.cumsum(-1) - probs", "mass_above = probs.cumsum(-1)"),
     "the token that crosses it included"),
    (Assignment.FILTER, ("row.topk(k).values[-1]", "row.topk(k + 1).values[-1]"), "top-k keeps the k most likely"),
    (Assignment.FILTER, ("        return out\n", "        return out.softmax(-1)\n"), "not probabilities"),
    (Assignment.ALLOCATOR, ("block = min(self.stamps", "block = max(self.stamps"), "the least recently freed block"),
    (Assignment.ALLOCATOR, ("del self.stamps[block]  # a prefix-cache hit",
                            "del self.stamps[min(self.stamps, key=self.stamps.__getitem__)]  # a prefix-cache hit"),
     "would be handed to another request while still referenced"),
    (Assignment.ALLOCATOR, ("self.stamps.update(blocks)  # the old", "pass  # the old"),
     "len() must count the free blocks"),
    (Assignment.ALLOCATOR, ("self.stamps.update(blocks)  # the old",
                            "self.stamps.update((b, 10**6 + s) for b, s in blocks)  # the old"),
     "with their OLD stamps"),
]


@pytest.mark.parametrize("assignment", list(REFERENCE), ids=lambda a: a.value)
def test_the_reference_passes_the_quick_checks(assignment):
    grade(assignment, load_student(SOLUTIONS / REFERENCE[assignment], assignment), engine=False)


# A kernel that reads no block divides 0 by 0: numpy (Triton's interpreter) warns; the grader names the rule.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("assignment,edit,rule", MISTAKES, ids=lambda x: x.value if isinstance(x, Assignment) else "")
def test_a_planted_mistake_fails_naming_its_rule(tmp_path, assignment, edit, rule):
    student = load_student(planted(tmp_path, assignment, *edit), assignment)
    with pytest.raises(AssignmentError) as error:
        grade(assignment, student, engine=False)
    assert "RULE" in str(error.value) and rule in str(error.value), str(error.value)


def test_the_state_machine_alone_catches_a_leaking_allocator(tmp_path):
    """Part 1's trace would catch it first; the scheduler's machine (the engine's own test) catches it too."""
    leaky = load_student(planted(tmp_path, Assignment.ALLOCATOR, "self.stamps.update(blocks)  # the old",
                                 "pass  # the old"), Assignment.ALLOCATOR)
    with pytest.raises(AssignmentError, match="(?s)every block is owned or free.*len\\(\\) must count the free blocks"):
        check_allocator_machine(leaky)


@pytest.mark.slow
@pytest.mark.parametrize("assignment", [Assignment.ATTENTION, Assignment.FILTER, Assignment.ALLOCATOR],
                         ids=lambda a: a.value)
def test_the_reference_runs_in_the_engine(assignment):
    grade(assignment, load_student(SOLUTIONS / REFERENCE[assignment], assignment), engine=True)


@pytest.mark.slow
def test_the_reference_kernel_runs_in_the_engine():
    """On CPU through Triton's interpreter (conftest.py sets TRITON_INTERPRET=1): slow."""
    grade(Assignment.KERNEL, load_student(SOLUTIONS / "kernel.py", Assignment.KERNEL), engine=True)


@pytest.mark.parametrize("assignment", list(STARTERS), ids=lambda a: a.value)
def test_every_starter_loads_and_is_reported_as_not_written_yet(assignment, capsys):
    assert main([assignment.value, str(ROOT / STARTERS[assignment]), "--no-engine"]) == 2
    assert "not written yet" in capsys.readouterr().out


def test_the_command_line_names_the_rule_and_exits_1(tmp_path, capsys):
    path = planted(tmp_path, Assignment.ATTENTION, "weights = scores.masked_fill(future, float(\"-inf\")).softmax(-1)",
                   "weights = scores.softmax(-1)")
    assert main(["attention", str(path), "--no-engine"]) == 1
    assert "broke a RULE: causal" in capsys.readouterr().out
    assert main(["attention", str(SOLUTIONS / "attention.py"), "--no-engine"]) == 0
    with pytest.raises(AssignmentError, match="define exactly one SamplingFilter subclass"):
        load_student(SOLUTIONS / "allocator.py", Assignment.FILTER)


@pytest.mark.slow
def test_the_engine_part_fails_an_allocator_that_evicts_the_wrong_prefix(tmp_path):
    """Most-recently-freed first keeps the engine correct but evicts the prefixes LRU keeps: fewer cache hits."""
    mru = load_student(planted(tmp_path, Assignment.ALLOCATOR, "block = min(self.stamps", "block = max(self.stamps"),
                       Assignment.ALLOCATOR)
    with pytest.raises(AssignmentError, match="hit the prefix cache for"):
        check_allocator_in_engine(mru)
