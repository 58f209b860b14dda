"""Your answers to the notebooks' exercises. Fill in each function, then run

    pytest exercises/          # every exercise, checked against the engine
    # or, in a notebook:  from minivllm.teaching.exercises import check; check("blocks_needed", blocks_needed)

Each function says which notebook it belongs to. Leave the signatures as they are. A wrong answer
is reported with the rule it broke and the smallest case that shows it.
"""

from __future__ import annotations

import torch


# 01 · a request's life -------------------------------------------------------------------------------
def is_decode(start: int, num_new_tokens: int, num_prompt_tokens: int) -> bool:
    """Is a scheduled chunk [start, start + num_new_tokens) of a request a decode (not a prefill)?"""
    raise NotImplementedError


# 02 · paged KV cache ---------------------------------------------------------------------------------
def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many KV blocks hold num_tokens tokens?"""
    raise NotImplementedError


def slot(position: int, block_table: list[int], block_size: int) -> int:
    """The flat KV slot of a token position, through the block table."""
    raise NotImplementedError


# 03 · prefix caching ---------------------------------------------------------------------------------
def cacheable_tokens(prompt_len: int, block_size: int) -> int:
    """At most how many tokens of a prompt can come from the prefix cache, if all of it is cached?"""
    raise NotImplementedError


# 04 · the scheduler ----------------------------------------------------------------------------------
def plan_step(running_uncomputed: list[int], waiting_lens: list[int], budget: int) -> list[int]:
    """Tokens each request gets in one step (running first, then waiting; chunked prefill on; a pool
    that never runs out; max_num_seqs never reached). Requests that get nothing are left out."""
    raise NotImplementedError


# 05 · memory pressure --------------------------------------------------------------------------------
def can_ever_run(prompt_len: int, max_tokens: int, num_blocks: int, block_size: int, max_model_len: int) -> bool:
    """Could this request ever finish on an otherwise empty engine?"""
    raise NotImplementedError


# 06 · the model runner -------------------------------------------------------------------------------
def logits_indices(query_lens: list[int], samples: list[bool]) -> list[int]:
    """Rows of the flat batch whose logits are sampled (samples[i]: does request i sample this step?)."""
    raise NotImplementedError


# 07 · paged attention --------------------------------------------------------------------------------
def causal_mask(q_len: int, ctx_len: int) -> torch.Tensor:
    """(q_len, ctx_len) bool mask: may query row r (the last q_len positions of ctx_len) see key j?"""
    raise NotImplementedError


# 08 · sampling ---------------------------------------------------------------------------------------
def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask of the tokens top-p keeps."""
    raise NotImplementedError


def min_p_keep(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Bool mask of the tokens min-p keeps."""
    raise NotImplementedError


# 09 · the engine loop --------------------------------------------------------------------------------
def overhead_fraction(step_time_s: float, forward_time_s: float) -> float:
    """Share of step time spent outside the model forward."""
    raise NotImplementedError


# 10 · serving ----------------------------------------------------------------------------------------
def sse_text(lines: list[str]) -> str:
    """The assistant text carried by a chat-completions SSE stream (its raw lines)."""
    raise NotImplementedError


# 12 · sampling outputs -------------------------------------------------------------------------------
def blocks_after_fan_out(prompt_len: int, block_size: int, n: int) -> int:
    """Physical KV blocks in use right after the n sequences of one request (n completions of a
    prompt of prompt_len tokens) are all admitted, prefix caching on and free blocks to spare."""
    raise NotImplementedError


def penalized_logits(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], repetition_penalty: float,
                     frequency_penalty: float, presence_penalty: float) -> torch.Tensor:
    """The logits after the repetition, frequency and presence penalties (vLLM's formulas and order)."""
    raise NotImplementedError


# 13 · speculative decoding ---------------------------------------------------------------------------
def greedy_accept(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """Greedy verification. target_ids[j] is the target's argmax after the last token and the first j
    drafts (len(draft_ids) + 1 of them). Return the tokens the step emits."""
    raise NotImplementedError


# 14 · tensor parallelism -----------------------------------------------------------------------------
def kv_heads_of_rank(num_kv_heads: int, rank: int, world_size: int) -> list[int]:
    """The KV heads (numbered as in the checkpoint, ascending) that rank `rank` of `world_size` holds.
    Either num_kv_heads divides by world_size or world_size by num_kv_heads."""
    raise NotImplementedError
