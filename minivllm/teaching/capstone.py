"""The capstone's grade: a student's scheduling policy, run through the scheduler and the engine.

    grade_policy(MyPolicy)            # or: python exercises/capstone/grade.py my_policy.py

First the submission rule (teaching/capstone_cheats.py): the policy may not import, call or subclass the
engine's own policies; it holds while every part runs. Then three parts, in order, each printing ✓ or
raising AssertionError that names the rule broken. In all three the policy runs inside `WatchedPolicy`
(teaching/capstone_watch.py): the seam's contract on every call (an empty waiting queue answered with
[], not an exception), and no write into a request or a queue.
  1. the scheduler's hypothesis state machine (teaching/scheduler_machine.py) under the policy, with
     random priorities: the seam's contract on every call, the block manager's invariants after every
     action, every request finishing at the end;
  2. behaviour (teaching/policy_behaviour.py): scenarios with open-loop arrivals that a policy can pass
     the contract and still fail — priority order, the victim (both arrival orders, and an old request
     beside a fresh one), bounded wait to the finish under memory pressure, stale state, open load; for
     `Assignment.FAIR_SHARE` the tenant rules (teaching/capstone_fair_share.py: each tenant's share of
     admissions, siblings counted, a late tenant, the victims' tenant) instead
     of the priority ones;
  3. a real engine scheduling with the policy on a tiny random model, under memory pressure (requests
     are preempted and recomputed) and mixed priorities: its greedy output must equal HF
     transformers' (teacher-forced, teaching/hf_check.py). A policy may change WHEN a request runs,
     never WHAT it generates.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from minivllm.engine.core.scheduling_policy import SchedulingPolicy
from minivllm.engine.request.sequence import FinishReason, Sequence
from minivllm.sampling_params import SamplingParams
from minivllm.teaching.capstone_cheats import check_own_policy
from minivllm.teaching.capstone_watch import WatchedPolicy
from minivllm.teaching.hf_check import assert_hf_greedy
from minivllm.teaching.policy_behaviour import Assignment, check_policy_behaviour
from minivllm.teaching.scheduler_machine import scheduler_machine


def check_policy_matches_hf(make_policy: Callable[[], SchedulingPolicy], model_dir: str | None = None) -> int:
    """Greedy output of an engine scheduling with the policy, under memory pressure (preemptions) and
    with mixed priorities, equals HF transformers' (teacher-forced). Returns the preemptions seen."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from minivllm.llm import LLM
    from minivllm.teaching.checkpoints import make_tiny_model

    model_dir = model_dir or str(make_tiny_model(tempfile.mkdtemp(), "qwen3"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=16,
              max_num_seqs=4, scheduling_policy=WatchedPolicy(make_policy()))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 9, 17, 3, 12, 7)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False,
                        priority=[rng.randint(-2, 2) for _ in prompts])
    for p, o in zip(prompts, outs):
        assert o.outputs[0].finish_reason == FinishReason.LENGTH, f"a request did not finish normally: {o.outputs[0]}"
        assert_hf_greedy(hf, p, o.outputs[0].token_ids)
    return llm.get_stats().num_preemptions


def grade_policy(make_policy: Callable[[], SchedulingPolicy], *, max_examples: int = 100, hf: bool = True,
                 shrink: bool = True, assignment: Assignment = Assignment.AGING) -> None:
    """The capstone's grade: the submission rule, then (1) the scheduler's state machine under the policy —
    contract, invariants, drain; (2) its behaviour in open-loop scenarios (the assignment's rules); (3)
    greedy output equals HF's with the policy in charge. Prints each part; raises AssertionError
    (naming the rule) on the first that fails. The search is derandomized, so a grade is reproducible;
    `shrink=False` skips looking for the smallest failing run (faster)."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    name = getattr(make_policy, "__name__", "policy")
    probe = make_policy()
    check_own_policy(type(probe))
    a, b = Sequence("a", [10, 11, 12], SamplingParams()), Sequence("b", [20, 21], SamplingParams())
    probe.admission_order([a, b]), probe.choose_victim([a, b])  # NotImplementedError: not written yet
    WatchedPolicy(make_policy()).admission_order([])  # asked every step, empty queue too (capstone_watch.py)

    def watched() -> SchedulingPolicy:
        return WatchedPolicy(make_policy())

    watched.__name__ = name
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    run_state_machine_as_test(scheduler_machine(watched, priorities=True), settings=settings(
        max_examples=max_examples, stateful_step_count=40, deadline=None, database=None, derandomize=True,
        report_multiple_bugs=False, phases=phases, suppress_health_check=list(HealthCheck)))
    print(f"✓ 1/3 {name}: the scheduler's state machine ({max_examples} random runs): contract, requests "
          "unchanged, invariants, drain")
    check_policy_behaviour(make_policy, assignment)
    rules = ("priority order, victim (both orders, by age), bounded wait to the finish, "
             if assignment is Assignment.AGING else "admission shares (siblings, late tenant), victims by tenant, ")
    print(f"✓ 2/3 {name}: behaviour under open-loop arrivals ({assignment.value}): {rules}state pruned, "
          "open load")
    if hf:
        preemptions = check_policy_matches_hf(make_policy)
        print(f"✓ 3/3 {name}: greedy output equals HF transformers ({preemptions} preemptions on the way)")
