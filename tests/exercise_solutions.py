"""Reference solutions to the notebook exercises (kept out of the notebooks on purpose)."""

from __future__ import annotations

import json

import torch

from minivllm.engine.core.scheduling_policy import SchedulingPolicy


def is_decode(start, num_new_tokens, num_prompt_tokens):
    return num_new_tokens == 1 and start >= num_prompt_tokens


def blocks_needed(num_tokens, block_size):
    return (num_tokens + block_size - 1) // block_size


def slot(position, block_table, block_size):
    return block_table[position // block_size] * block_size + position % block_size


def cacheable_tokens(prompt_len, block_size):
    return (prompt_len - 1) // block_size * block_size


def plan_step(running_uncomputed, waiting_lens, budget):
    out = []
    for n in running_uncomputed + waiting_lens:
        if budget == 0:
            break
        out.append(min(n, budget))
        budget -= out[-1]
    return out


def can_ever_run(prompt_len, max_tokens, num_blocks, block_size, max_model_len):
    if prompt_len >= max_model_len:
        return False
    final = min(prompt_len + max_tokens, max_model_len)
    return blocks_needed(final - 1, block_size) <= num_blocks


def logits_indices(query_lens, samples):
    ends = torch.tensor(query_lens).cumsum(0) - 1
    return [int(e) for e, s in zip(ends, samples) if s]


def causal_mask(q_len, ctx_len):
    return torch.arange(ctx_len)[None, :] <= torch.arange(ctx_len - q_len, ctx_len)[:, None]


def top_p_keep(probs, top_p):
    p, order = probs.sort(descending=True)
    keep_sorted = (p.cumsum(0) - p) < top_p
    return torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)


def min_p_keep(probs, min_p):
    return probs >= min_p * probs.max()


def overhead_fraction(step_time_s, forward_time_s):
    return 1 - forward_time_s / step_time_s


def sse_text(lines):
    text = ""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return text


def blocks_after_fan_out(prompt_len, block_size, n):
    shared = (prompt_len - 1) // block_size  # full blocks the cache can serve (>= 1 token is computed)
    return shared + n  # plus each sequence's own last block


def penalized_logits(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    x = logits.clone()
    seen = set(prompt_ids) | set(output_ids)
    for t in seen:
        x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
    for t in set(output_ids):
        x[t] -= frequency_penalty * output_ids.count(t) + presence_penalty
    return x


def greedy_accept(draft_ids, target_ids):
    out = []
    for d, t in zip(draft_ids, target_ids):
        if d != t:
            return out + [t]
        out.append(d)
    return out + [target_ids[len(draft_ids)]]


def kv_heads_of_rank(num_kv_heads, rank, world_size):
    if num_kv_heads < world_size:  # replicated: the head of this rank's query heads
        return [rank * num_kv_heads // world_size]
    per_rank = num_kv_heads // world_size
    return list(range(rank * per_rank, (rank + 1) * per_rank))


class AgingPolicy(SchedulingPolicy):
    """The capstone, priority with aging: a lower `priority` first, but each AGING_STEPS steps since a
    request arrived make it one level more urgent. The age is kept while it runs and across a preemption,
    and the victim is the least urgent by the same aged urgency: a request that aged its way in is not
    preempted for the newcomers it overtook, so it finishes, not only starts, in bounded time."""

    name = "aging"
    AGING_STEPS = 4

    def __init__(self):
        self.clock = 0  # calls of admission_order so far
        self.arrived = {}  # request id -> (sequence, clock when first seen); dropped once it finishes

    def _urgency(self, seq):
        return seq.priority - (self.clock - self.arrived[seq.request_id][1]) / self.AGING_STEPS

    def _see(self, seqs):
        for s in seqs:
            self.arrived.setdefault(s.request_id, (s, self.clock))

    def admission_order(self, waiting):
        self.clock += 1
        self.arrived = {r: (s, t) for r, (s, t) in self.arrived.items() if not s.is_finished}
        self._see(waiting)
        return sorted(waiting, key=lambda s: (self._urgency(s), s.arrival_index))

    def choose_victim(self, candidates):
        self._see(candidates)
        return max(candidates, key=lambda s: (self._urgency(s), s.arrival_index))
