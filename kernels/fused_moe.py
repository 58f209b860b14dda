"""Fused MoE: a mixture-of-experts MLP as one grouped matmul over the routes sorted by expert (vLLM's fused_moe).

An MoE layer sends each of T tokens to its top-k experts (router: minivllm/layers/moe_router.py); expert e is
a gated MLP, `w2[e] @ (silu(gate) * up)` with `gate | up = w13[e] @ x`, and a token's output is its k
experts' outputs weighted by the router's `topk_weights`:

    out[t] = sum_j  topk_weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t]),   e = topk_ids[t, j]

The plain way, `naive_fused_moe`, loops over experts: gather the tokens routed to e, two matmuls, scatter
back. That is 2E small matmuls (E = 128 for Qwen3-30B-A3B), each its own launch and most on a few rows.
The fused way computes every route in ONE launch: a route r = t*k + j is a row, the rows are sorted by
expert and each expert's group padded to whole tiles of BLOCK_M rows (moe_align.py draws it), so every
tile multiplies by one expert's weights, found from the tile's entry in `expert_ids`:

    sorted_token_ids  [ 1  4 | 2  S | 0  3 | 5  S ]      S: sentinel, a masked row (no load, no store)
    expert_ids        [  0   |  1   |  2   |  2   ]      one entry a BLOCK_M block of rows
                         |      |      |      |
    program (m, n):    rows of block m  x  tile n of w[expert_ids[m]]   ->  c[route, n-tile]
                       A rows: x[route // top_k]      (the token's hidden row, read in place, no gather)

    grid = (blocks of BLOCK_M sorted rows, tiles of BLOCK_N output columns)
    each program: acc (BLOCK_M, BLOCK_N) fp32 = sum over K in steps of BLOCK_K of A_tile @ W_tile^T;
                  optionally acc *= topk_weights[route]; store to c[route] (the unsorted route order)

`fused_moe` calls that one kernel twice, as vLLM does:

    1. c1 = x @ w13[e]^T     A row = hidden[route // top_k]    c1 (T*k, 2I)
    2. a  = silu(c1[:, :I]) * c1[:, I:]                           a  (T*k, I)   torch, on the device
    3. c3 = a @ w2[e]^T * topk_weights[route]   A row = a[route]  c3 (T*k, H)   (the weight in fp32, before rounding)
    4. out[t] = sum_j c3[t*k + j]                                 out (T, H)    k rows summed in fp32

Why it is faster: two launches instead of 2E (and the gathers), the hidden rows read in place, tiles full
wherever an expert has >= BLOCK_M routes, and an expert's weight tile read once a block of its routes (the
blocks of one expert run side by side, so mostly from L2). At decode (T*k routes, most experts unused) each
used expert has one block and only the used experts' weights are read: the bytes that set an MoE decode's
speed. Padding costs at most BLOCK_M - 1 wasted rows an expert; BLOCK_M is small (16) when
routes are few. Not done here: vLLM's grouped launch order for L2 reuse, tuned configs per GPU, quantized
weights, expert parallelism (an expert id of -1 for another rank's expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .moe_align import MoeAlignment, moe_align_block_size


@dataclass(frozen=True)
class MoeBlockConfig:
    """The kernel's tile: BLOCK_M sorted routes x BLOCK_N output columns, BLOCK_K of the reduction a step."""
    block_m: int
    block_n: int
    block_k: int

    def __post_init__(self) -> None:
        for name, size in (("block_m", self.block_m), ("block_n", self.block_n), ("block_k", self.block_k)):
            if size < 16 or size & (size - 1):
                raise ValueError(f"MoeBlockConfig.{name}={size}: make it a power of two >= 16 "
                                 "(tl.arange takes powers of two, tl.dot at least 16)")


def default_block_config(num_routes: int, num_experts: int) -> MoeBlockConfig:
    """Small row blocks when routes per expert are few (decode: padding would dominate), larger ones when
    each expert has many (prefill: fewer, fuller tiles). vLLM's untuned defaults, in the same spirit."""
    if num_routes <= 2 * num_experts:
        return MoeBlockConfig(16, 64, 64)
    return MoeBlockConfig(64, 64, 32)


def _check_inputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
    """Shapes and dtypes of the shared contract; each error names the argument and what it should be."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (num_tokens, hidden_size), got shape {tuple(hidden.shape)}")
    T, H = hidden.shape
    if w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2:
        raise ValueError(f"w13 must be (num_experts, 2 * intermediate_size, hidden_size={H}), "
                         f"got shape {tuple(w13.shape)}")
    E, I = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w2 must be (num_experts={E}, hidden_size={H}, intermediate_size={I}) to match w13, "
                         f"got shape {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights and topk_ids must both be (num_tokens={T}, top_k), got shapes "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be an integer tensor (expert ids), got {topk_ids.dtype}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must have hidden's dtype ({hidden.dtype})")


def naive_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Reference: one expert at a time, in fp32 throughout; the result in hidden's dtype.
    hidden (T, H), w13 (E, 2I, H), w2 (E, H, I), topk_weights (T, k), topk_ids (T, k) -> (T, H)."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
    I = w2.shape[2]
    x = hidden.float()  # (T, H)
    out = torch.zeros_like(x)  # (T, H)
    for e in range(w13.shape[0]):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)  # (n,) each: the routes to expert e
        if token.numel() == 0:
            continue
        gate_up = x[token] @ w13[e].float().T  # (n, 2I)
        act = F.silu(gate_up[:, :I]) * gate_up[:, I:]  # (n, I)
        y = act @ w2[e].float().T  # (n, H)
        out.index_add_(0, token, y * topk_weights[token, slot].float()[:, None])
    return out.to(hidden.dtype)


@triton.jit
def _fused_moe_kernel(
        a_ptr,  # (rows, K): the input rows; route r reads row r // top_k
        b_ptr,  # (E, N, K): the experts' weights, each an (N, K) matrix as nn.Linear stores it
        c_ptr,  # (T*k, N): the output, one row a route, in route order
        topk_weights_ptr,  # (T*k,) fp32: each route's router weight (read when MUL_ROUTED_WEIGHT)
        sorted_token_ids_ptr,  # (max_padded,) int32: route ids by expert, padded with num_valid_tokens
        expert_ids_ptr,  # (max_padded // BLOCK_SIZE_M,) int32: each block's expert
        num_tokens_post_padded_ptr,  # (1,) int32: sorted rows in use; blocks at or past it do nothing
        N, K,  # the output's columns, the reduction length
        num_valid_tokens,  # T*k: a sorted id this large is the sentinel (a padding row)
        stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
        top_k: tl.constexpr,  # routes per A row: k on the first call (A = hidden), 1 on the second
        MUL_ROUTED_WEIGHT: tl.constexpr,  # scale each row by its route's weight before the store
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (exact, not TF32), "tf32" for 16-bit inputs
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # --- this block's rows: routes of one expert (the grid covers the worst case; the tail stops here) ---
    if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    route = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)  # (BLOCK_M,)
    row_ok = route < num_valid_tokens  # sentinel rows: never loaded, never stored
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (route // top_k)[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    # (BLOCK_K, BLOCK_N): the expert's weight tile, read transposed through its strides (no copy)
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    # --- the grouped matmul: this block's A rows against its expert's weight tile, fp32 accumulation ---
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_SIZE_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    # --- route weight (second call), then each row back to its route's place ---
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + route, mask=row_ok, other=0.0)  # (BLOCK_M,)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + route[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def invoke_fused_moe_kernel(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
                            alignment: MoeAlignment, top_k: int, mul_routed_weight: bool,
                            config: MoeBlockConfig) -> None:
    """One launch: c[r] = b[expert of r] @ a[r // top_k] (times topk_weights[r] if mul_routed_weight) for
    every route r in `alignment` (made with config.block_m). a (rows, K), b (E, N, K), c (T*k, N) written in
    place, topk_weights (T*k,) contiguous fp32."""
    assert topk_weights.is_contiguous() and topk_weights.dtype == torch.float32
    N, K = b.shape[1:]  # b (E, N, K)
    num_blocks = alignment.expert_ids.numel()
    grid = (num_blocks, triton.cdiv(N, config.block_n))
    _fused_moe_kernel[grid](
        a, b, c, topk_weights, alignment.sorted_token_ids, alignment.expert_ids,
        alignment.num_tokens_post_padded, N, K, c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        top_k=top_k, MUL_ROUTED_WEIGHT=mul_routed_weight,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", BLOCK_SIZE_M=config.block_m,
        BLOCK_SIZE_N=config.block_n, BLOCK_SIZE_K=config.block_k)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeBlockConfig | None = None) -> torch.Tensor:
    """naive_fused_moe's contract through the grouped-matmul kernel, called twice (the module docstring).
    hidden (T, H), w13 (E, 2I, H), w2 (E, H, I), topk_weights (T, k), topk_ids (T, k) -> (T, H) in
    hidden's dtype; the intermediates are rounded to that dtype, accumulation is fp32. `config`: the
    tile (default_block_config's when None)."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
    T, H = hidden.shape
    E, I, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    if T == 0:
        return torch.empty_like(hidden)
    config = config or default_block_config(T * k, E)
    alignment = moe_align_block_size(topk_ids, config.block_m, E)
    weights = topk_weights.float().contiguous().view(-1)  # (T*k,) route r = t*k + j
    # --- 1. gate | up of every route ---
    gate_up = torch.empty(T * k, 2 * I, dtype=hidden.dtype, device=hidden.device)  # (T*k, 2I)
    invoke_fused_moe_kernel(hidden, w13, gate_up, weights, alignment, top_k=k, mul_routed_weight=False,
                            config=config)
    # --- 2. the activation (elementwise: the routes' order does not matter) ---
    act = F.silu(gate_up[:, :I]) * gate_up[:, I:]  # (T*k, I)
    # --- 3. down, each route scaled by its router weight ---
    down = torch.empty(T * k, H, dtype=hidden.dtype, device=hidden.device)  # (T*k, H)
    invoke_fused_moe_kernel(act, w2, down, weights, alignment, top_k=1, mul_routed_weight=True, config=config)
    # --- 4. each token's k routes summed ---
    return down.view(T, k, H).sum(1, dtype=torch.float32).to(hidden.dtype)  # (T, H)
