"""Checks for the notebooks' exercises: each compares a student's function with the engine itself.

    from minivllm.exercises import check
    check("blocks_needed", my_blocks_needed)     # prints ✓, or raises AssertionError with a case

The references below call the real engine code (or are asserted equal to it by the test-suite), so a
passing check means "agrees with minivllm". Solutions are not here: only the engine's own behaviour.
Teachers: `pytest exercises/` runs every check against `exercises/student.py` (see docs/teachers.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import ScheduledSequence, Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.layers.sampler import SamplingRow, SamplingTensors, apply_top_k_top_p_min_p
from minivllm.sampling_params import SamplingParams


def _seq(n: int, start: int = 10, max_tokens: int = 4) -> Sequence:
    return Sequence(f"r{start}", list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


# --- references: the engine's answer for each exercise -------------------------------------------------
def _ref_blocks_needed(num_tokens: int, block_size: int) -> int:
    return BlockManager(1, block_size).blocks_needed(num_tokens)


def _ref_slot(position: int, block_table: list[int], block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size


def _ref_cacheable_tokens(prompt_len: int, block_size: int) -> int:
    bm = BlockManager(64, block_size)
    first, again = _seq(prompt_len), _seq(prompt_len)
    prefix = bm.get_computed_blocks(first)
    bm.allocate(first, prompt_len, prefix)
    first.num_computed_tokens = prompt_len
    bm.cache_full_blocks(first)
    return bm.get_computed_blocks(again).num_tokens


def _ref_is_decode(start: int, num_new_tokens: int, num_prompt_tokens: int) -> bool:
    return not ScheduledSequence(_seq(num_prompt_tokens), start, num_new_tokens).is_prefill


def _ref_plan_step(running_uncomputed: list[int], waiting_lens: list[int], budget: int) -> list[int]:
    """Tokens per request in one step (running first, then waiting), with a pool that never runs out."""
    sched = Scheduler(BlockManager(4096, 16, enable_prefix_caching=False), max_num_seqs=1024,
                      max_num_batched_tokens=budget, max_model_len=10**6)
    for i, n in enumerate(running_uncomputed):  # running requests with n tokens still to compute
        s = _seq(n, start=1000 * (i + 1))
        s.status = SequenceStatus.RUNNING
        sched.running.append(s)
    for i, n in enumerate(waiting_lens):
        sched.add_sequence(_seq(n, start=50000 + 1000 * i))
    return [s.num_new_tokens for s in sched.schedule().scheduled]


def _ref_can_ever_run(prompt_len: int, max_tokens: int, num_blocks: int, block_size: int, max_model_len: int) -> bool:
    if prompt_len >= max_model_len:
        return False
    final = min(prompt_len + max_tokens, max_model_len)
    return BlockManager(num_blocks, block_size).blocks_needed(final - 1) <= num_blocks


def _ref_logits_indices(query_lens: list[int], samples: list[bool]) -> list[int]:
    rows, out = 0, []
    for n, s in zip(query_lens, samples):
        rows += n
        if s:
            out.append(rows - 1)
    return out


def _ref_causal_mask(q_len: int, ctx_len: int) -> torch.Tensor:
    from minivllm.layers.attention import AttentionMetadata
    from minivllm.layers.torch_attention import TorchAttentionBackend

    meta = AttentionMetadata(torch.zeros(q_len, dtype=torch.long), torch.tensor([0, q_len]),
                             torch.tensor([ctx_len]), torch.zeros(1, ctx_len, dtype=torch.int32), [q_len],
                             [ctx_len], 1)
    if q_len == 1:
        return torch.ones(1, ctx_len, dtype=torch.bool)
    TorchAttentionBackend(1, 1, 16).prepare(meta)
    return meta.plan.prefills[0].mask


def _keep(probs: torch.Tensor, **kw: float) -> torch.Tensor:
    row = [SamplingRow(1.0, int(kw.get("top_k", 0)), kw.get("top_p", 1.0), kw.get("min_p", 0.0), 0, 0)]
    t = SamplingTensors.from_params(row, probs.numel(), probs.device)
    return apply_top_k_top_p_min_p(probs.log()[None], t)[0] > float("-inf")


def _ref_top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    return _keep(probs, top_p=top_p)


def _ref_min_p_keep(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    return _keep(probs, min_p=min_p)


def _ref_overhead_fraction(step_time_s: float, forward_time_s: float) -> float:
    from dataclasses import fields

    from minivllm.engine.stats import EngineStats

    zeros = {f.name: 0 for f in fields(EngineStats)}
    return EngineStats(**{**zeros, "step_time_s": step_time_s, "forward_time_s": forward_time_s}).overhead_fraction


def _ref_sse_text(lines: list[str]) -> str:
    import json

    text = ""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                text += choice.get("delta", {}).get("content") or choice.get("text") or ""
    return text


# --- cases ------------------------------------------------------------------------------------------
def _probs(rng: random.Random, n: int) -> torch.Tensor:
    p = torch.tensor([rng.random() ** 3 + 1e-3 for _ in range(n)])
    return p / p.sum()


def _sse_lines(rng: random.Random) -> list[str]:
    import json

    pieces = ["Pa", "ris", " is", "", " the", " capital."][: rng.randint(2, 6)]
    lines = [f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]})}", ""]
    for p in pieces:
        lines += [f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': p}}]})}", ""]
    return lines + ["data: [DONE]", ""]


def _cases(name: str, rng: random.Random) -> list[tuple]:
    if name == "blocks_needed":
        return [(rng.randint(0, 200), rng.choice([1, 4, 16, 32])) for _ in range(200)]
    if name == "slot":
        return [(p, [rng.randrange(100) for _ in range(p // 4 + 1)], 4) for p in range(0, 40)]
    if name == "cacheable_tokens":
        return [(n, b) for n in range(1, 40) for b in (1, 4, 8)]
    if name == "is_decode":
        return [(rng.randint(0, 30), rng.randint(1, 3), rng.randint(1, 30)) for _ in range(200)]
    if name == "plan_step":
        return [([rng.randint(1, 3) for _ in range(rng.randint(0, 4))],
                 [rng.randint(1, 20) for _ in range(rng.randint(0, 4))], rng.randint(1, 30)) for _ in range(60)]
    if name == "can_ever_run":
        return [(rng.randint(1, 80), rng.randint(1, 80), rng.randint(1, 12), rng.choice([4, 8, 16]),
                 rng.randint(16, 100)) for _ in range(300)]
    if name == "logits_indices":
        return [([rng.randint(1, 9) for _ in range(k)], [rng.random() < 0.7 for _ in range(k)]) for k in range(1, 8)]
    if name == "causal_mask":
        return [(q, c) for c in range(1, 12) for q in range(1, c + 1)]
    if name == "top_p_keep":
        return [(_probs(rng, 12), rng.choice([0.1, 0.5, 0.8, 0.95])) for _ in range(40)]
    if name == "min_p_keep":
        return [(_probs(rng, 12), rng.choice([0.05, 0.1, 0.3, 0.9])) for _ in range(40)]
    if name == "overhead_fraction":
        return [(s, s * rng.random()) for s in (0.5, 1.0, 3.2)]
    if name == "sse_text":
        return [(_sse_lines(rng),) for _ in range(10)]
    raise KeyError(name)


REFERENCES: dict[str, Callable[..., Any]] = {
    "blocks_needed": _ref_blocks_needed, "slot": _ref_slot, "cacheable_tokens": _ref_cacheable_tokens,
    "is_decode": _ref_is_decode, "plan_step": _ref_plan_step, "can_ever_run": _ref_can_ever_run,
    "logits_indices": _ref_logits_indices, "causal_mask": _ref_causal_mask, "top_p_keep": _ref_top_p_keep,
    "min_p_keep": _ref_min_p_keep, "overhead_fraction": _ref_overhead_fraction, "sse_text": _ref_sse_text,
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and bool((a == b).all())
    if isinstance(b, float):
        return abs(float(a) - b) < 1e-9
    return a == b


def check(name: str, fn: Callable[..., Any], seed: int = 0) -> None:
    """Run `fn` on the exercise's cases and compare with the engine; raise on the first mismatch."""
    cases = _cases(name, random.Random(seed))
    for args in cases:
        expected, got = REFERENCES[name](*args), fn(*args)
        assert _same(got, expected), f"{name}{args!r}: you returned {got!r}, the engine says {expected!r}"
    print(f"✓ {name}: all {len(cases)} cases agree with the engine")
