"""The exercise checks: they accept correct answers, reject wrong ones naming the rule broken, and match
the engine. The capstone's grader: passes the built-in policies, fails broken ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import exercise_solutions as solutions
import numpy as np
import pytest
import torch

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.engine.core.scheduling_policy import FCFSPolicy, PriorityPolicy
from minivllm.engine.request.sequence import Sequence
from minivllm.engine.request.step_types import ScheduledSequence, SchedulerOutput
from minivllm.sampling_params import SamplingParams
from minivllm.teaching.capstone import check_policy_matches_hf, grade_policy
from minivllm.teaching.hands_on import AssignmentError
from minivllm.teaching.exercises import REFERENCES, RULES, check
from minivllm.teaching.policy_behaviour import PolicyBehaviourError, check_policy_behaviour

CAPSTONE = Path(__file__).resolve().parent.parent / "exercises" / "capstone"


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_correct_solutions_pass(name):
    check(name, getattr(solutions, name))


@pytest.mark.parametrize("name,wrong,rule", [
    ("blocks_needed", lambda n, b: n // b, "round UP"),
    ("cacheable_tokens", lambda n, b: n // b * b, "at least one prompt token is always computed"),
    ("plan_step", lambda r, w, b: [min(n, b) for n in r + w], "one token budget is shared"),
    ("plan_step", lambda r, w, b: solutions.plan_step(w, r, b), "running requests come first"),
    ("causal_mask", lambda q, c: torch.ones(q, c, dtype=torch.bool), "lower-triangular"),
    ("top_p_keep", lambda p, t: p.cumsum(0) <= t, "most likely token is always kept"),
    ("min_p_keep", lambda p, m: p >= m, "min-p is relative"),
    ("can_ever_run", lambda p, m, nb, bs, ml: p < ml and -(-(p + m - 1) // bs) <= nb, "caps the final length"),
    ("can_ever_run", lambda p, m, nb, bs, ml: p < ml and -(-min(p + m, ml) // bs) <= nb, "never fed back"),
    ("is_decode", lambda s, n, p: n == 1, "starts inside the prompt"),
    ("blocks_after_fan_out", lambda p, b, n: -(-p // b) * n, "share the prompt's full blocks"),
    ("blocks_after_fan_out", lambda p, b, n: -(-p // b), "its own last prompt block"),
    ("blocks_after_fan_out", lambda p, b, n: p // b + (n if p % b else 0), "cannot take its last block"),
    ("blocks_after_fan_out", lambda p, b, n: -(-p // b) + n, "n = 1 is a plain request"),
    ("blocks_after_fan_out", lambda p, b, n: p // b + n, "n = 1 is a plain request"),
    ("blocks_after_fan_out", lambda p, b, n: (p - 1) // b + n - 1, "n = 1 is a plain request"),
    ("penalized_logits", lambda lg, p, o, r, f, pr: lg, "repetition penalty"),
    ("greedy_accept", lambda d, t: [x for x, y in zip(d, t) if x == y], "always emits one token"),
    ("kv_heads_of_rank", lambda kv, r, n: list(range(r * kv // n, (r + 1) * kv // n)), "exactly ONE KV head"),
    ("kv_heads_of_rank", lambda kv, r, n: [r * kv // n] if kv < n else list(range(r, kv, n)), "CONSECUTIVE"),
])
def test_wrong_solutions_fail_naming_the_rule(name, wrong, rule):
    with pytest.raises(AssertionError, match="the engine says") as err:
        check(name, wrong)
    assert "Rule broken: " in str(err.value) and rule in str(err.value)


def test_the_last_tokens_kv_is_probed_often():
    """Counting the last token's KV used to fail 2 cases of 300: the cases now aim at that edge."""
    with pytest.raises(AssertionError, match=r"(\d+) of 300 cases") as err:
        check("can_ever_run", lambda p, m, nb, bs, ml: p < ml and -(-min(p + m, ml) // bs) <= nb)
    assert int(str(err.value).split(": ")[1].split(" of")[0]) >= 50


@pytest.mark.parametrize("name,answer", [
    ("plan_step", lambda r, w, b: tuple(solutions.plan_step(r, w, b))),
    ("kv_heads_of_rank", lambda kv, r, n: np.array(solutions.kv_heads_of_rank(kv, r, n))),
    ("causal_mask", lambda q, c: solutions.causal_mask(q, c).numpy()),
    ("min_p_keep", lambda p, m: solutions.min_p_keep(p, m).numpy()),
    ("top_p_keep", lambda p, t: solutions.top_p_keep(p, t).tolist()),
    ("blocks_needed", lambda n, b: np.int64(solutions.blocks_needed(n, b))),
    ("is_decode", lambda s, n, p: np.bool_(solutions.is_decode(s, n, p))),
    ("overhead_fraction", lambda s, f: torch.tensor(solutions.overhead_fraction(s, f))),
])
def test_a_correct_answer_in_another_container_is_accepted(name, answer):
    check(name, answer)


@pytest.mark.parametrize("name,answer,told", [
    ("kv_heads_of_rank", lambda kv, r, n: set(solutions.kv_heads_of_rank(kv, r, n)), "Return a list (in order)"),
    ("top_p_keep", lambda p, t: solutions.top_p_keep(p, t)[None], "Return a 1-D bool tensor of shape (12,)"),
    ("min_p_keep", lambda p, m: solutions.min_p_keep(p, m).float(), "Return a 1-D bool tensor"),
    ("blocks_needed", lambda n, b: n / b, "Return an int"),
    ("sse_text", lambda lines: [solutions.sse_text(lines)], "Return a str"),
])
def test_a_wrong_type_or_shape_is_told_what_to_return(name, answer, told):
    with pytest.raises(AssertionError, match="wrong type or shape") as err:
        check(name, answer)
    assert told in str(err.value) and "Rule broken" not in str(err.value), str(err.value)


def _sse(lines, *, skip_done=True, skip_blank=True, strip_prefix=True):
    """A student's `sse_text`, with one of its guards left out."""
    text = ""
    for line in lines:
        if (skip_blank and not line.startswith("data: ")) or (skip_done and line == "data: [DONE]"):
            continue
        delta = json.loads(line[6:] if strip_prefix else line)["choices"][0]["delta"]
        text += delta.get("content") or ""
    return text


@pytest.mark.parametrize("answer,rule", [
    (lambda lines: _sse(lines, skip_done=False), "skip the [DONE] sentinel"),
    (lambda lines: _sse(lines, skip_blank=False), "blank lines separate events"),
    (lambda lines: _sse(lines, strip_prefix=False), "after the 'data: ' prefix"),
])
def test_an_exception_in_the_answer_is_named_by_the_rule_it_breaks(answer, rule):
    assert _sse(["data: [DONE]"]) == ""  # the full guard set is a correct answer
    with pytest.raises(AssertionError, match="your code raised") as err:
        check("sse_text", answer)
    assert "Rule broken: " in str(err.value) and rule in str(err.value), str(err.value)


def test_an_exercise_not_written_yet_is_not_a_broken_rule():
    def stub(*args):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):  # exercises/test_student.py skips on it
        check("sse_text", stub)


def test_rule_texts_do_not_state_the_formula():
    texts = " ".join(r.text for rules in RULES.values() for r in rules)
    for formula in ("min_p ×", "1 - forward", "× num_kv_heads", "cumulative query lengths - 1", "final_len - 1"):
        assert formula not in texts


def test_every_exercise_has_rules():
    assert set(RULES) == set(REFERENCES)


def test_references_match_the_running_engine(qwen3_dir):
    """Where a reference restates engine code, compare it with the real ModelRunner / LLMEngine."""
    engine = LLMEngine(EngineConfig(model=qwen3_dir, block_size=4, num_kv_blocks=40, max_model_len=64))
    seqs = [Sequence(f"s{i}", list(range(3, 3 + n)), SamplingParams()) for i, n in enumerate([5, 9, 2])]
    for s, table in zip(seqs, ([7, 3], [1, 9, 4], [12])):
        s.block_table = table
    plan = SchedulerOutput([ScheduledSequence(seqs[0], 0, 5), ScheduledSequence(seqs[1], 2, 4),
                            ScheduledSequence(seqs[2], 0, 2)])
    batch = engine.model_runner.prepare_inputs(plan).inputs
    expected_slots = [REFERENCES["slot"](p, s.seq.block_table, 4) for s in plan.scheduled
                      for p in range(s.start, s.start + s.num_new_tokens)]
    assert batch.attn_metadata.slot_mapping.tolist() == expected_slots
    samples = [s.samples for s in plan.scheduled]
    assert batch.logits_indices.tolist() == REFERENCES["logits_indices"]([5, 4, 2], samples)
    for prompt_len, max_tokens in [(10, 5), (63, 1), (64, 1), (20, 200), (3, 150)]:
        seq = engine.make_sequence("x", {"prompt_token_ids": [5] * prompt_len}, SamplingParams(max_tokens=max_tokens))
        assert (engine.unservable_reason(seq) is None) == REFERENCES["can_ever_run"](prompt_len, max_tokens, 40, 4, 64)


# --- the capstone's grader ----------------------------------------------------------------------------
def test_capstone_grader_passes_a_correct_aging_policy():
    grade_policy(solutions.AgingPolicy, max_examples=25, hf=False)


@pytest.mark.parametrize("policy", [FCFSPolicy, PriorityPolicy, solutions.AgingPolicy])
def test_capstone_hf_check_passes(policy, qwen3_dir):
    assert check_policy_matches_hf(policy, qwen3_dir) > 0  # the check ran under memory pressure


@pytest.mark.parametrize("policy,rule", [(FCFSPolicy, "a more urgent request (lower `priority`) is admitted"),
                                         (PriorityPolicy, "a stream of urgent arrivals cannot keep it out")])
def test_capstone_grader_fails_the_built_in_policies_on_behaviour(policy, rule):
    """They keep the contract but neither is an aging policy (part 2); handed in, they are refused first
    (the submission rule: the policy is the student's own)."""
    with pytest.raises(PolicyBehaviourError) as err:
        check_policy_behaviour(policy)
    assert rule in str(err.value), str(err.value)
    with pytest.raises(AssignmentError, match="is the engine's own policy"):
        grade_policy(policy, max_examples=25, hf=False, shrink=False)


def test_capstone_grader_command(tmp_path):
    """The student's command: the starter is "not written yet" (2); a correct policy passes (0); vLLM's
    priority policy, subclassed, is refused by the submission rule (1)."""
    grade = [sys.executable, str(CAPSTONE / "grade.py")]
    r = subprocess.run(grade, capture_output=True, text=True, timeout=900)
    assert r.returncode == 2 and "not written yet" in r.stdout, r.stdout + r.stderr
    mine = tmp_path / "mine.py"
    mine.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                    "from exercise_solutions import AgingPolicy\n\n\nclass Mine(AgingPolicy):\n    name = 'mine'\n")
    r = subprocess.run([*grade, str(mine), "--examples", "10", "--no-hf"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "Mine passed" in r.stdout, r.stdout + r.stderr
    mine.write_text("from minivllm.engine.core.scheduling_policy import PriorityPolicy\n\n\n"
                    "class Mine(PriorityPolicy):\n    name = 'mine'\n")
    r = subprocess.run([*grade, str(mine), "--examples", "10", "--no-hf"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 1 and "the policy assignment is written by you" in r.stdout, r.stdout + r.stderr
