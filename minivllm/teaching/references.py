"""The engine's answer to each exercise of the notebooks: `REFERENCES[name](*args)`.

Each reference asks the real engine whenever it can — a `BlockManager`, a `Scheduler`, the sampler's
filters, the rejection sampler — on a tiny, throw-away instance, so "agrees with the reference" means
"agrees with minivllm". Where a reference restates a line of engine code instead (the slot of a
position, the rows whose logits are sampled), `tests/test_exercises.py` asserts it equal to the
running engine. These are not model solutions: a student's answer is meant to be written from the
idea, not from here (the worked solutions are in `tests/exercise_solutions.py`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import torch

from minivllm.engine.core.block_manager import BlockManager
from minivllm.engine.core.scheduler import Scheduler
from minivllm.engine.processing.parallel_sampling import fan_out
from minivllm.engine.request.sequence import Sequence, SequenceStatus
from minivllm.engine.request.step_types import ScheduledSequence
from minivllm.layers.sampler import SamplingRow, SamplingTensors, apply_top_k_top_p_min_p
from minivllm.sampling_params import SamplingParams


def _seq(n: int, start: int = 10, max_tokens: int = 4) -> Sequence:
    return Sequence(f"r{start}", list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


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
    bm.cache_blocks(first, prompt_len)
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
    from minivllm.layers.attention_interface import AttentionMetadata
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

    from minivllm.engine.metrics.stats import EngineStats

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


def _ref_blocks_after_fan_out(prompt_len: int, block_size: int, n: int) -> int:
    """Physical blocks in use right after the n sequences of one request are admitted (a roomy pool,
    prefix caching on): each sequence asks the prefix cache, then allocates, in turn, as the scheduler
    admits them in one step."""
    bm = BlockManager(64, block_size)
    request = Sequence("r", list(range(10, 10 + prompt_len)), SamplingParams(n=n, max_tokens=4, ignore_eos=True))
    for seq in fan_out(request):
        prefix = bm.get_computed_blocks(seq)
        bm.allocate(seq, prompt_len - prefix.num_tokens, prefix)
    return bm.num_blocks - bm.num_free_blocks


def _ref_penalized_logits(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                          repetition_penalty: float, frequency_penalty: float, presence_penalty: float) -> torch.Tensor:
    from minivllm.layers.logits_processors import RowProcessing, apply_logits_processing

    row = RowProcessing(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                        repetition_penalty=repetition_penalty, prompt_token_ids=array("i", prompt_ids),
                        output_token_ids=list(output_ids))
    return apply_logits_processing(logits[None].clone(), [row])[0]


def _ref_greedy_accept(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """Greedy verification through the engine's rejection sampler: p is one-hot on the target's choice."""
    from minivllm.engine.spec_decode.rejection_sampler import naive_rejection_sample

    k, V = len(draft_ids), max(draft_ids + target_ids) + 1
    K = max(k, 1)
    p = torch.zeros(1, K, V)
    for j in range(k):
        p[0, j, target_ids[j]] = 1.0
    drafts = torch.tensor([draft_ids + [0] * (K - k)])
    tokens, accepted = naive_rejection_sample(p, None, drafts, torch.tensor([k]), torch.zeros(1, K),
                                              torch.zeros(1, K, V), torch.tensor([target_ids[k]]))
    return tokens[0, : int(accepted[0]) + 1].tolist()


def _ref_kv_heads_of_rank(num_kv_heads: int, rank: int, world_size: int) -> list[int]:
    """The KV heads rank `rank` holds, asked of `ShardLayout` on a model whose other sizes all divide."""
    from minivllm.models.hf_config import parse_model_spec
    from minivllm.models.sharding import ShardLayout

    heads = num_kv_heads * world_size  # query heads: a multiple of both
    spec = parse_model_spec(dict(architectures=["LlamaForCausalLM"], vocab_size=8 * world_size, hidden_size=8 * heads,
                                 intermediate_size=8 * world_size, num_hidden_layers=1, num_attention_heads=heads,
                                 num_key_value_heads=num_kv_heads, head_dim=8))
    layout = ShardLayout.of(spec, rank, world_size)
    return list(range(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads))


REFERENCES: dict[str, Callable[..., Any]] = {
    "blocks_needed": _ref_blocks_needed, "slot": _ref_slot, "cacheable_tokens": _ref_cacheable_tokens,
    "is_decode": _ref_is_decode, "plan_step": _ref_plan_step, "can_ever_run": _ref_can_ever_run,
    "logits_indices": _ref_logits_indices, "causal_mask": _ref_causal_mask, "top_p_keep": _ref_top_p_keep,
    "min_p_keep": _ref_min_p_keep, "overhead_fraction": _ref_overhead_fraction, "sse_text": _ref_sse_text,
    "blocks_after_fan_out": _ref_blocks_after_fan_out, "penalized_logits": _ref_penalized_logits,
    "greedy_accept": _ref_greedy_accept, "kv_heads_of_rank": _ref_kv_heads_of_rank,
}
