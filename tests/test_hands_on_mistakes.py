"""The hands-on graders hold against wrong solutions that passed them before, and refuse cheats.

Two tables. MISTAKES: one edit of a reference solution (tests/hands_on_solutions/), planted as in
tests/test_hands_on.py, that the probes used to pass or blamed on the wrong rule: a block size or a
scale written as a constant, an online softmax that forgets to rescale, a top-k that drops a tie at the
k-th rank, a filter that applies the temperature again, an allocator whose iter() lies about the order.
CHEATS: whole files in tests/hands_on_mistakes/ that import, call or subclass the engine's own
implementation of the part (under an alias, through a star import, by names built at run time), or a
"kernel" that launches no @triton.jit function; each is refused naming the rule, by the source check,
the MRO check or the watch on the calls (teaching/submission_rules.py). WRONG: whole files from a
student walkthrough that passed, or were blamed on another rule: attention computed in torch around a
copy kernel, q scaled in place, bf16 scores, a dropped 1-key last block, rows counted from 0, a filter
that edits its logits, min-p before top-p, top-p's boundary at exactly top_p, a restore to the head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minivllm.teaching.grade_hands_on import grade
from minivllm.teaching.hands_on import Assignment, AssignmentError, load_student
from minivllm.layers.sampler import TopKTopPMinP
from minivllm.teaching.hands_on_sampling import PURE_RULE, check_filter_in_engine
from minivllm.teaching.submission_rules import RULES, source_violations
from test_hands_on import SOLUTIONS, planted

CHEATS_DIR = Path(__file__).resolve().parent / "hands_on_mistakes"
NOT_YOURS = "may not import, call or subclass the engine's own implementation"
ONLINE = "online softmax: when a block raises the running max"

MISTAKES = [
    # (assignment, the edit, the rule the grader must name)
    (Assignment.ATTENTION, ("bs = meta.block_size", "bs = 4"), "the block size is the pool's"),
    (Assignment.ATTENTION, ("keys) * self.scale", "keys) * 0.25"), "the scale self.scale = head_dim ** -0.5"),
    (Assignment.KERNEL, ("BLOCK_SIZE=block_size)", "BLOCK_SIZE=4)"), "the block size is the pool's"),
    (Assignment.KERNEL, ("scale, block_tables.stride(0), NUM", "0.25, block_tables.stride(0), NUM"),
     "the scale self.scale = head_dim ** -0.5"),
    (Assignment.KERNEL, ("acc = acc * alpha + ", "acc = acc + "), ONLINE),
    (Assignment.KERNEL, ("l = l * alpha + ", "l = l + "), ONLINE),
    (Assignment.FILTER, ("kth = row.topk(k).values[-1]\n                row[row < kth] = NEG_INF",
                         "row[row.argsort(descending=True)[k:]] = NEG_INF"), "a tie AT the k-th rank keeps more"),
    (Assignment.FILTER, ("out = logits.clone()  # (R, V)", "out = logits / sampling.temperatures[:, None]  # (R, V)"),
     "must not apply the temperature again"),
    (Assignment.ALLOCATOR, ("return iter(sorted(self.stamps, key=self.stamps.__getitem__))",
                            "return iter(self.stamps)"), "iter() lists each free block once, in the order take()"),
    (Assignment.ALLOCATOR, ("return iter(sorted(self.stamps, key=self.stamps.__getitem__))",
                            "return iter(sorted(self.stamps, key=self.stamps.__getitem__, reverse=True))"),
     "iter() lists each free block once, in the order take()"),
]

CHEATS = [
    # (assignment, file, what the message must say: the rule, and where it was seen)
    (Assignment.ATTENTION, "attention_delegates.py", (NOT_YOURS, "TorchAttentionBackend as Fast")),
    (Assignment.ATTENTION, "attention_subclasses.py", (NOT_YOURS, "mine.TorchAttentionBackend")),
    (Assignment.ATTENTION, "attention_star_import.py", (NOT_YOURS, "from kernels.paged_attention import *")),
    (Assignment.ATTENTION, "attention_hidden_call.py", (NOT_YOURS, "it called kernels.paged_attention")),
    (Assignment.ATTENTION, "attention_hidden_base.py", (NOT_YOURS, "it subclasses minivllm.layers.torch_attention")),
    (Assignment.KERNEL, "kernel_calls_engine.py", (NOT_YOURS, "from kernels.paged_attention import paged_attention")),
    (Assignment.KERNEL, "kernel_hidden_call.py", (NOT_YOURS, "it called kernels.paged_attention")),
    (Assignment.KERNEL, "kernel_in_torch.py", ("launches a @triton.jit function defined in your file",
                                               "the kernels it launched: none")),
    (Assignment.KERNEL, "kernel_unlaunched_jit.py", ("launches a @triton.jit function defined in your file",
                                                     "the kernels it launched: none")),
    (Assignment.FILTER, "filter_calls_engine.py", (NOT_YOURS, "import apply_top_k_top_p_min_p as mine")),
    (Assignment.FILTER, "filter_subclasses.py", (NOT_YOURS, "sampler.TopKTopPMinP")),
    (Assignment.FILTER, "filter_hidden_call.py", (NOT_YOURS, "called minivllm.layers.sampler.apply_top_k_top_p_min_p")),
    (Assignment.ALLOCATOR, "allocator_subclasses.py", (NOT_YOURS, "import LRUAllocator as Base")),
    (Assignment.ALLOCATOR, "allocator_star_import.py", (NOT_YOURS, "block_allocator import *")),
    (Assignment.ALLOCATOR, "allocator_hidden_call.py", (NOT_YOURS, "called minivllm.engine.core.block_allocator.LRU")),
]


# A kernel that reads no block divides 0 by 0: numpy (Triton's interpreter) warns; the grader names the rule.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("assignment,edit,rule", MISTAKES, ids=lambda x: x.value if isinstance(x, Assignment) else "")
def test_a_mistake_the_probes_used_to_miss_fails_naming_its_rule(tmp_path, assignment, edit, rule):
    student = load_student(planted(tmp_path, assignment, *edit), assignment)
    with pytest.raises(AssignmentError) as error:
        grade(assignment, student, engine=False)
    assert "RULE" in str(error.value) and rule in str(error.value), str(error.value)


def test_a_missing_rescale_is_not_blamed_on_the_last_block(tmp_path):
    """The online-softmax probe comes before "last block", and its contexts end on a block boundary."""
    student = load_student(planted(tmp_path, Assignment.KERNEL, "acc = acc * alpha + ", "acc = acc + "),
                           Assignment.KERNEL)
    with pytest.raises(AssignmentError) as error:
        grade(Assignment.KERNEL, student, engine=False)
    assert "probe 'online softmax'" in str(error.value) and "partly filled" not in str(error.value)


@pytest.mark.parametrize("assignment,name,says", CHEATS, ids=lambda x: x if isinstance(x, str) else "")
def test_a_cheat_is_refused_naming_the_rule(assignment, name, says):
    with pytest.raises(AssignmentError) as error:
        grade(assignment, load_student(CHEATS_DIR / name, assignment), engine=False)
    for words in says:
        assert words in str(error.value), str(error.value)
    assert "RULE" in str(error.value)


def test_every_cheat_file_is_graded_here():
    """A cheat file nobody grades proves nothing (the speed_* files belong to the performance track)."""
    mine = {p.name for p in CHEATS_DIR.glob("*.py") if p.name.split("_")[0] in {a.value for a in Assignment}}
    assert mine == {name for _, name, _ in CHEATS + WRONG}


WRONG = [
    # (assignment, file, what the message must say)
    (Assignment.KERNEL, "kernel_torch_then_copy.py", ("the attention is computed in your kernel",
                                                      "torch ran aten.bmm on a float tensor outside the kernel's")),
    (Assignment.KERNEL, "kernel_blocks_exclusive.py", ("probe 'last block'", "ceil(n / block_size) blocks")),
    (Assignment.ATTENTION, "attention_mutates_q.py", ("forward changes none of q, k and v in place", "q differ from")),
    (Assignment.ATTENTION, "attention_bf16_scores.py", ("computed in fp32 whatever q's dtype", "'fp32 softmax'")),
    (Assignment.ATTENTION, "attention_last_key_dropped.py", ("probe 'last block'", "ceil(n / block_size) blocks")),
    (Assignment.ATTENTION, "attention_rows_from_zero.py", ("a decode row is the LAST position of its context",)),
    (Assignment.FILTER, "filter_in_place.py", (PURE_RULE, "your filter changed ['logits'] in place")),
    (Assignment.FILTER, "filter_min_p_first.py", ("probe 'in order'", "the three run in order")),
    (Assignment.FILTER, "filter_top_p_boundary.py", ("probe 'top-p boundary'", "kept 2 tokens, expected 1")),
    (Assignment.ALLOCATOR, "allocator_restore_to_head.py", ("not to the end nor to the head",
                                                            "are at places [0, 1, 2] of your free list")),
]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("assignment,name,says", WRONG, ids=lambda x: x if isinstance(x, str) else "")
def test_a_wrong_solution_from_the_walkthrough_fails_naming_its_rule(assignment, name, says):
    with pytest.raises(AssignmentError) as error:
        grade(assignment, load_student(CHEATS_DIR / name, assignment), engine=False)
    for words in says:
        assert words in str(error.value), str(error.value)
    assert "RULE" in str(error.value)


def test_the_temperature_probe_names_another_rule_when_the_output_is_not_twice_tempered():
    """A row at temperature 0.7 that differs from the reference, but not as the temperature applied twice
    does, is named by its parameters' rule (here two filters on: their order)."""
    from minivllm.teaching.hands_on_sampling import TEMPERATURE_RULE, rule_of_row, tempered_twice, tensors_for

    rows, temperatures = ((10, 0.9, 0.05),), (0.7,)
    logits, t = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 2.5, tensors_for(rows, temperatures)
    twice = TopKTopPMinP()(logits / 0.7, t)
    assert tempered_twice(twice, logits, t, 0)
    assert not tempered_twice(TopKTopPMinP()(logits.clone(), tensors_for(((3, 1.0, 0.0),), temperatures)), logits, t, 0)
    assert "run in order" in rule_of_row(10, 0.9, 0.05) and TEMPERATURE_RULE != rule_of_row(10, 0.9, 0.05)


CORRECT = {"attention": ["tests/hands_on_solutions/attention.py", "exercises/hands_on/1_attention/my_attention.py"],
           "kernel": ["tests/hands_on_solutions/kernel.py", "exercises/hands_on/2_kernel/my_kernel.py"],
           "filter": ["tests/hands_on_solutions/sampling_filter.py", "exercises/hands_on/3_filter/my_filter.py"],
           "allocator": ["tests/hands_on_solutions/allocator.py", "exercises/hands_on/4_allocator/my_allocator.py"],
           "policy": ["exercises/capstone/my_policy.py"],
           "speed": ["tests/hands_on_solutions/speed.py", "exercises/hands_on/5_speed/my_speed.py"]}


@pytest.mark.parametrize("assignment", list(RULES), ids=str)
def test_the_references_and_starters_use_nothing_refused(assignment):
    """The rules refuse the engine's implementations, not the seams a correct solution imports."""
    for path in CORRECT[assignment]:
        assert source_violations((SOLUTIONS.parent.parent / path).read_text(), RULES[assignment]) == [], path


def test_a_string_in_a_docstring_is_not_a_cheat():
    source = ('"""Unlike TorchAttentionBackend, mine loops."""\n'
              'import importlib\nm = importlib.import_module("kernels")\n')
    found = source_violations(source, RULES["attention"])
    assert len(found) == 1 and "line 3" in found[0], found


def test_the_engine_part_names_the_temperature_rule(tmp_path):
    """Part 2 alone, on a filter that applies the temperature again: the rule, not just "the tokens differ"."""
    again = load_student(planted(tmp_path, Assignment.FILTER,
                                 "out = logits.clone()  # (R, V)",
                                 "out = logits / torch.where(sampling.temperatures > 0, sampling.temperatures, 1.0)"
                                 "[:, None]"), Assignment.FILTER)
    with pytest.raises(AssignmentError, match="must not apply the temperature again"):
        check_filter_in_engine(again)


def test_the_engine_part_names_a_filter_that_edits_its_input(tmp_path):
    """Making the greedy row's temperature 1 in place turns it into a sampled row: the probes (no greedy row)
    cannot see it; the engine run names the rule."""
    fix_greedy = "sampling.temperatures[sampling.temperatures == 0] = 1.0\n        out = logits.clone()"
    edits = load_student(planted(tmp_path, Assignment.FILTER, "out = logits.clone()  # (R, V)", fix_greedy),
                         Assignment.FILTER)
    grade(Assignment.FILTER, edits, engine=False)  # part 1 passes
    with pytest.raises(AssignmentError) as error:
        check_filter_in_engine(edits)
    assert PURE_RULE in str(error.value) and "sampling.temperatures" in str(error.value), str(error.value)


def test_the_command_line_refuses_a_cheat_with_exit_1(capsys):
    from minivllm.teaching.grade_hands_on import main

    assert main(["filter", str(CHEATS_DIR / "filter_calls_engine.py"), "--no-engine"]) == 1
    out = capsys.readouterr().out
    assert "failed" in out and NOT_YOURS in out and "apply_top_k_top_p_min_p as mine" in out


def test_the_watch_sees_a_launch_of_the_engines_kernel_and_puts_triton_back():
    """A launch is recorded by the kernel launched (its inside is not traced): the engine's is refused."""
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.kv_cache_write import _kv_cache_write_kernel
    from minivllm.teaching.submission_watch import Watch

    if not isinstance(_kv_cache_write_kernel, InterpretedFunction):
        pytest.skip("the kernel is compiled here (a GPU): this test launches it on CPU tensors, interpreted")
    run = InterpretedFunction.run
    k, cache, slots = torch.ones(2, 1, 4), torch.zeros(4, 1, 4), torch.tensor([3, 1])
    with Watch(RULES["kernel"]) as watch:
        _kv_cache_write_kernel[(2,)](k, k, cache, cache.clone(), slots, 4, BLOCK=4)
    assert watch.calls == ["kernels.kv_cache_write._kv_cache_write_kernel (a kernel launch)"], watch.calls
    assert InterpretedFunction.run is run and torch.equal(cache[3], k[0])
