"""The exercise checks: they accept correct answers, reject wrong ones, and match the engine."""

from __future__ import annotations

import exercise_solutions as solutions
import pytest
import torch

from minivllm import LLMEngine
from minivllm.config import EngineConfig
from minivllm.engine.scheduler import ScheduledSequence, SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.exercises import REFERENCES, check
from minivllm.sampling_params import SamplingParams


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_correct_solutions_pass(name):
    check(name, getattr(solutions, name))


@pytest.mark.parametrize("name,wrong", [
    ("blocks_needed", lambda n, b: n // b),
    ("cacheable_tokens", lambda n, b: n // b * b),  # forgets that one token must be computed
    ("plan_step", lambda r, w, b: [min(n, b) for n in r + w]),  # ignores the shared budget
    ("causal_mask", lambda q, c: torch.ones(q, c, dtype=torch.bool)),
    ("top_p_keep", lambda p, t: p.cumsum(0) <= t),
])
def test_wrong_solutions_fail(name, wrong):
    with pytest.raises(AssertionError, match="the engine says"):
        check(name, wrong)


def test_references_match_the_running_engine(qwen3_dir):
    """Where a reference restates engine code, compare it with the real ModelRunner / LLMEngine."""
    engine = LLMEngine(EngineConfig(model=qwen3_dir, block_size=4, num_kv_blocks=40, max_model_len=64))
    seqs = [Sequence(f"s{i}", list(range(3, 3 + n)), SamplingParams()) for i, n in enumerate([5, 9, 2])]
    for s, table in zip(seqs, ([7, 3], [1, 9, 4], [12])):
        s.block_table = table
    plan = SchedulerOutput([ScheduledSequence(seqs[0], 0, 5), ScheduledSequence(seqs[1], 2, 4),
                            ScheduledSequence(seqs[2], 0, 2)])
    batch = engine.model_runner.prepare_inputs(plan)
    expected_slots = [REFERENCES["slot"](p, s.seq.block_table, 4) for s in plan.scheduled
                      for p in range(s.start, s.start + s.num_new_tokens)]
    assert batch.attn_metadata.slot_mapping.tolist() == expected_slots
    samples = [s.samples for s in plan.scheduled]
    assert batch.logits_indices.tolist() == REFERENCES["logits_indices"]([5, 4, 2], samples)
    for prompt_len, max_tokens in [(10, 5), (63, 1), (64, 1), (20, 200), (3, 150)]:
        seq = engine.make_sequence("x", {"prompt_token_ids": [5] * prompt_len}, SamplingParams(max_tokens=max_tokens))
        assert (engine.unservable_reason(seq) is None) == REFERENCES["can_ever_run"](prompt_len, max_tokens, 40, 4, 64)
