"""Top-k routing, and the routes sorted by expert: the two steps before any expert computes.

    router_logits (T, E) --softmax (fp32)--> probs (T, E) --top-k--> topk_weights, topk_ids (T, k)
                                                           [renormalize: weights / their sum]

Every token picks its k experts independently, so one expert's tokens are scattered over the batch.
An expert computes best on a contiguous block of its own rows, so the T*k routes are sorted by expert:

    topk_ids  (T=3, k=2)  [[2, 0],       route r = token r // k, slot r % k
                           [0, 1],       flat:  2 0 0 1 2 1
                           [2, 1]]
    sorted by expert (stable):  route_ids 1 2 | 3 5 | 0 4     expert_ids 0 0 | 1 1 | 2 2
                                token_ids 0 1 | 1 2 | 0 2     counts [2, 2, 2], offsets [0, 2, 4, 6]

Expert e's rows are `token_ids[offsets[e]:offsets[e+1]]`; `counts` is the step's expert load, and an
expert with count 0 is never read (at decode, most of them). This is vLLM's `select_experts` (softmax
scoring, `renormalize` = HF's `norm_topk_prob`) and the sort that its `moe_align_block_size` pads into
blocks for the Triton kernel (kernels/fused_moe.py).

The top-k weights stay in float32, as vLLM keeps them; HF casts them to the model's dtype before weighting
the experts (`router_top_value.to(router_logits.dtype)`). In float32 the two are the same, exactly; in
bf16 / fp16 they agree within that dtype's rounding, not bit for bit.

The load per expert is counted with `scatter_add_` into zeros (`count_routes`), not `torch.bincount`: on
CUDA bincount reads the ids' min and max back to the host, two syncs in every sparse layer of every step.
The count and the stable sort live in kernels/moe_align.py, one of each for every MoE path (this one, the
Triton kernel's alignment, the CPU kernel's), and a layer counts its routes once a forward: `FusedMoE`
keeps the count as `last_load` and hands it here as `counts`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minivllm.kernels.moe_align import count_routes, sort_by_expert


class RoutingResult(NamedTuple):
    topk_weights: torch.Tensor  # (T, k) float32: each chosen expert's share of the token's output
    topk_ids: torch.Tensor  # (T, k) int64: the chosen experts, highest probability first


class SortedRoutes(NamedTuple):
    token_ids: torch.Tensor  # (T*k,) int64: the token each sorted route reads
    expert_ids: torch.Tensor  # (T*k,) int64: the expert of each sorted route (non-decreasing)
    counts: torch.Tensor  # (E,) int64: routes per expert, the step's expert load
    offsets: torch.Tensor  # (E+1,) int64: expert e's routes are [offsets[e], offsets[e+1])
    route_ids: torch.Tensor  # (T*k,) int64: each sorted route's index in topk_ids.flatten() (its weight's too)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> RoutingResult:
    """router_logits (T, E) -> the k experts of each token and their weights, as HF's Qwen-MoE routers:
    softmax in float32 over all E, the top k of it, divided by their sum if `renormalize`. The weights stay
    float32 (vLLM's choice; HF casts them to the model dtype first: equal in fp32, within rounding in bf16)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (T, E)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # (T, k) each
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return RoutingResult(topk_weights, topk_ids)


def sort_tokens_by_expert(topk_ids: torch.Tensor, num_experts: int,
                          counts: torch.Tensor | None = None) -> SortedRoutes:
    """topk_ids (T, k) -> the T*k routes grouped by expert (stable: within an expert, token order).
    `counts` (E,): the routes per expert if already counted (`FusedMoE.last_load`), else counted here."""
    k = topk_ids.shape[1]
    flat = topk_ids.flatten()  # (T*k,)
    expert_ids, route_ids = sort_by_expert(flat)  # (T*k,) each
    if counts is None:
        counts = count_routes(flat, num_experts)  # (E,)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    return SortedRoutes(route_ids // k, expert_ids, counts, offsets, route_ids)

