"""`moe_align_block_size`: the routes of a step sorted by expert, each expert's group padded to whole blocks.

A step of T tokens with top-k routing has T*k routes; route r = t*k + j is token t's j-th expert
`topk_ids[t, j]`. A grouped matmul wants each tile of BLOCK_M rows to belong to ONE expert, so that the
tile multiplies by one weight matrix. So the routes are sorted by expert (stably: within an expert, in
route order) and each expert's group is padded up to a multiple of BLOCK_M with a sentinel, T*k, that no
route has. Block b then holds rows [b*BLOCK_M, (b+1)*BLOCK_M) of `sorted_token_ids`, all of expert
`expert_ids[b]`:

    topk_ids (T=3, k=2)   [[2, 0],      routes 0..5 -> experts 2 0 | 1 2 | 0 2
                           [1, 2],
                           [0, 2]]
    BLOCK_M = 2, E = 4:   expert 0: routes 1 4      expert 1: route 2      expert 2: routes 0 3 5   expert 3: -
    sorted_token_ids      [1 4 | 2 S | 0 3 | 5 S | S S ...]       S = 6 = T*k, the sentinel (a masked row)
    expert_ids            [ 0  |  1  |  2  |  2  | -1  ...]       -1: a block past the end
    num_tokens_post_padded  8

Invariants (tests/kernels/test_fused_moe_kernel.py): every route appears exactly once; each expert's group
is its count rounded up to BLOCK_M (no more); groups come in expert order, an expert without routes has
no block; `num_tokens_post_padded` is the padded total, a multiple of BLOCK_M.

Nothing here waits for the device: the buffers have a size known before the routes are read, the worst
case T*k + min(E, T*k) * (BLOCK_M - 1) (at most min(E, T*k) experts are used, each wasting under one
block), and the kernel stops at `num_tokens_post_padded`, read on the device. So the same launch could
sit in a CUDA graph, whatever the routes (the engine does not graph-capture MoE models yet). At decode
(T*k routes over E >> T*k experts) that bound keeps the grid small: one block a used expert, not one an
expert. vLLM does this in a CUDA kernel (csrc/moe); here torch ops do it, a handful of small launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class MoeAlignment(NamedTuple):
    """The routes of a step in the order the grouped matmul reads them (vLLM's three outputs)."""
    sorted_token_ids: torch.Tensor  # (max_padded,) int32: a route index t*k + j, or the sentinel T*k
    expert_ids: torch.Tensor  # (max_padded // block_size,) int32: each block's expert, -1 past the end
    num_tokens_post_padded: torch.Tensor  # (1,) int32: the rows in use, a multiple of block_size


def max_padded_routes(num_routes: int, block_size: int, num_experts: int) -> int:
    """The buffer length: every route plus under one block of padding for each expert that can be used,
    rounded up to whole blocks."""
    padded = num_routes + min(num_experts, num_routes) * (block_size - 1)
    return -(-padded // block_size) * block_size


def count_routes(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """expert_ids (N,) int64 -> (E,) int64 routes per expert, on the ids' device without a host sync: a
    `scatter_add_` into zeros, not torch.bincount, which on CUDA reads the ids' min and max back to the host."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids.device)  # (E,)
    return counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))


def sort_by_expert(expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids (N,) -> (sorted expert ids (N,), order (N,)): the routes grouped by expert, stably (within an
    expert, in route order), so a token's k outputs are always summed in one order. Every MoE path sorts here."""
    sorted_experts, order = torch.sort(expert_ids, stable=True)
    return sorted_experts, order


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> MoeAlignment:
    """topk_ids (T, k) integer, each in [0, num_experts). Returns the sorted, block-padded routes."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be (num_tokens, top_k), got shape {tuple(topk_ids.shape)}")
    if block_size < 1 or num_experts < 1:
        raise ValueError(f"block_size ({block_size}) and num_experts ({num_experts}) must be at least 1")
    device = topk_ids.device
    experts = topk_ids.flatten().long()  # (R,) expert of each route, R = T*k
    num_routes = experts.numel()
    max_padded = max_padded_routes(num_routes, block_size, num_experts)
    # --- how many routes each expert has, and where its padded group starts ---
    counts = count_routes(experts, num_experts)  # (E,)
    padded_counts = (counts + block_size - 1) // block_size * block_size  # (E,)
    starts = counts.cumsum(0) - counts  # (E,) first sorted position of each expert, unpadded
    padded_starts = padded_counts.cumsum(0) - padded_counts  # (E,) the same, padded
    # --- each route's row: its expert's padded start plus its rank among that expert's routes ---
    sorted_experts, order = sort_by_expert(experts)  # (R,) each
    rank = torch.arange(num_routes, device=device) - starts[sorted_experts]  # (R,)
    sorted_token_ids = torch.full((max_padded,), num_routes, dtype=torch.int32, device=device)
    sorted_token_ids[padded_starts[sorted_experts] + rank] = order.to(torch.int32)
    # --- each block's expert: the group its first row falls in (blocks past the end: -1) ---
    total = padded_counts.sum().reshape(1)  # (1,)
    block_starts = torch.arange(0, max_padded, block_size, device=device)  # (max_padded // block_size,)
    block_expert = torch.searchsorted(padded_starts + padded_counts, block_starts, right=True)
    expert_ids = torch.where(block_starts < total, block_expert, -1).to(torch.int32)
    return MoeAlignment(sorted_token_ids, expert_ids, total.to(torch.int32))
