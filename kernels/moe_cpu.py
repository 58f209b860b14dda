"""`cpu_fused_moe`: a mixture-of-experts layer's experts on CPU, reading only the active experts' weights.

An MoE layer holds E experts (Qwen3-30B-A3B: 128 a layer) but routes each token through k of them (8),
so a decode step of a few tokens touches a few experts. On a CPU that step is bound by reading weights
from memory, exactly as a dense decode step is (kernels/skinny_gemm.py), and its floor is the bytes of
the experts it uses, not the layer's: with 64 experts and top-8, one token reads at most 1/8 of them.

    pack_moe_experts(w13 (E, 2I, H), w2 (E, H, I))       once, at warm-up (minivllm/cpu/moe_method.py)
        every expert's two weights in skinny_gemm's layout of 16-column blocks, one tensor for each:
        w13 (E, 2I/16, H, 16) fp32 or (E, 2I/16, H/2, 16, 2) bf16; w2 likewise over (H, I).
        expert e's blocks are w13[e]: one contiguous run, read front to back by its product.

    cpu_fused_moe(x (T, H), packed, topk_weights (T, k), topk_ids (T, k), counts (E,)) -> (T, H), every step:
        routes sorted by expert (route r = token r // k's j-th choice; the sort and the count are
        kernels/moe_align.py's, the count the layer's own when it hands it in); for each ACTIVE expert e
        (the others are never touched) over its n_e gathered rows:
            rows <= SKINNY_MAX_ROWS:  h = skinny_gemm(x_e, w13[e])            (n_e, 2I)
                                      a = silu_and_mul(h)                      (n_e, I)   one C++ pass
                                      y = skinny_gemm(a, w2[e])                (n_e, H)
            more rows (prefill):      the same with F.linear on expert e's weight laid back out
                                      (one copy of it, small next to a GEMM of that many rows)
        out[t] += topk_weight[t, j] * y_route, summed in fp32, rounded to x's dtype once.

Packing replaces the checkpoint's layout (the method swaps the layer's parameters for the packed ones):
the experts are most of an MoE model's bytes, so keeping both layouts, as the dense skinny form does
(matmul_forms.py keeps `weight.skinny` beside the weight), would double the model in memory.

Why a Python loop over the active experts and not one C++ entry that walks them: measured on 2 AMD EPYC
Zen 5 cores (1 thread, bf16, 64 experts of 256 x 1024, top-8, 6 layers, the experts read from memory), a
layer's decode step took 1212 us through `cpu_fused_moe` against 1141 us for the bare loop of its kernel
calls: the sort, the gather and the weighted sum cost ~6 %, the most one C++ entry could win back.

The reference is kernels/fused_moe.py's `naive_fused_moe` (a loop over experts, fp32 accumulation);
tests/kernels/test_moe_cpu_kernel.py compares them at decode and prefill sizes, native and AVX2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .moe_align import count_routes, sort_by_expert
from .silu_and_mul import silu_and_mul
from .skinny_gemm import LANES, pack_skinny_weight, skinny_gemm

# An expert's rows at or below this go through skinny_gemm (8 share one read of the weight; 9-16 read a
# column group's second pass from cache); more rows are a GEMM's work: F.linear on the laid-back weight.
SKINNY_MAX_ROWS = 16


class PackedExperts(NamedTuple):
    """Every expert's weights in skinny_gemm's packed layout; expert e's are w13[e] and w2[e]."""

    w13: torch.Tensor  # (E, ceil(2I/16), H, 16) fp32 | (E, ceil(2I/16), H/2, 16, 2) bf16: gate rows, then up rows
    w2: torch.Tensor  # (E, ceil(H/16), I, 16) fp32 | (E, ceil(H/16), I/2, 16, 2) bf16: down_proj
    hidden_size: int  # H
    intermediate_size: int  # I (this rank's share under tensor parallelism)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def can_pack_moe(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `pack_moe_experts` takes these weights: CPU, fp32 or bf16, and even H and I for bf16 (k pairs)."""
    if w13.device.type != "cpu" or w13.dim() != 3 or w2.dim() != 3 or w13.dtype != w2.dtype:
        return False
    return w13.dtype == torch.float32 or (w13.dtype == torch.bfloat16 and w13.shape[2] % 2 == 0
                                          and w2.shape[2] % 2 == 0)


def pack_moe_experts(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts:
    """w13 (E, 2I, H) (gate_proj rows then up_proj rows) and w2 (E, H, I) -> PackedExperts. One copy of each."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2] \
            or w13.shape[2] != w2.shape[1]:
        raise ValueError(f"pack_moe_experts needs w13 (E, 2I, H) and w2 (E, H, I); got w13 {tuple(w13.shape)} "
                         f"and w2 {tuple(w2.shape)}")
    if not can_pack_moe(w13, w2):
        raise ValueError(f"pack_moe_experts packs CPU float32 weights, or bfloat16 with an even hidden and "
                         f"intermediate size; got {w13.dtype} / {w2.dtype} on {w13.device}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    return PackedExperts(_pack_each(w13), _pack_each(w2), w2.shape[1], w2.shape[2])


def _pack_each(w: torch.Tensor) -> torch.Tensor:
    """(E, out, in) -> E packed weights in one tensor. Padded to whole 16-row blocks per expert first, so the
    (E * out, in) matrix's blocks never straddle two experts and one pack_skinny_weight packs them all."""
    experts, out_features, in_features = w.shape
    pad = -out_features % LANES
    if pad:
        w = F.pad(w, (0, 0, 0, pad))  # (E, out + pad, in)
    packed = pack_skinny_weight(w.reshape(-1, in_features))  # (E * blocks, in, 16) | (E * blocks, in / 2, 16, 2)
    return packed.view(experts, -1, *packed.shape[1:])


def unpack_expert(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """One expert's packed weight (blocks, in, 16) | (blocks, in / 2, 16, 2) -> its (out_features, in) matrix,
    a copy."""
    blocks = packed.shape[0]
    if packed.dtype == torch.bfloat16:  # k pairs move as one int32, as pack_skinny_weight moved them
        pairs = packed.view(torch.int32).view(blocks, -1, LANES).transpose(1, 2).contiguous()  # (blocks, 16, in / 2)
        return pairs.view(torch.bfloat16).view(blocks * LANES, -1)[:out_features]
    return packed.transpose(1, 2).reshape(blocks * LANES, -1)[:out_features]


class RoutesByExpert(NamedTuple):
    """A step's T * k routes sorted by expert: route i reads token `token_ids[i]` with weight `weights[i]`;
    `experts` lists the active experts with their (start, end) range of sorted routes."""

    token_ids: torch.Tensor  # (T * k,) int64
    weights: torch.Tensor  # (T * k,) float32
    experts: list[tuple[int, int, int]]  # (expert, start, end), active experts only, ascending


def sort_routes(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                counts: torch.Tensor | None = None) -> RoutesByExpert:
    """A few small ops and three short lists whatever E is: per-step work follows the routes, not the experts.
    `counts` (E,): the routes per expert as the layer counted them (`FusedMoE.last_load`); None: counted here,
    after checking every id lies in [0, num_experts)."""
    expert_of_route, order = sort_by_expert(topk_ids.reshape(-1))  # (T * k,) each; route r: token r // k
    if counts is None:
        if expert_of_route.numel():
            lo, hi = expert_of_route[[0, -1]].tolist()  # sorted: the smallest and the largest id
            if not 0 <= lo <= hi < num_experts:
                raise ValueError(f"cpu_fused_moe: topk_ids must lie in [0, {num_experts}); got {lo} .. {hi}")
        counts = count_routes(expert_of_route, num_experts)  # (E,)
    active = counts.nonzero().flatten()  # (n_active,) ascending
    n, ends = counts[active], counts.cumsum(0)[active]  # (n_active,) each
    experts = list(zip(active.tolist(), (ends - n).tolist(), ends.tolist()))
    return RoutesByExpert(order // topk_ids.shape[1], topk_weights.reshape(-1)[order].float(), experts)


def cpu_fused_moe(hidden: torch.Tensor, packed: PackedExperts, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """hidden (T, H) through the experts `topk_ids` (T, k) chose, weighted by `topk_weights` (T, k) -> (T, H) in
    hidden's dtype; `counts` (E,) the routes per expert if already counted. Call `load_cpu_kernels()`
    (kernels/cpu_build.py) first; it must say available."""
    T, H = hidden.shape
    if H != packed.hidden_size or hidden.dtype != packed.w13.dtype:
        raise ValueError(f"cpu_fused_moe: hidden is {tuple(hidden.shape)} {hidden.dtype}; the experts take "
                         f"(T, {packed.hidden_size}) {packed.w13.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"cpu_fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be (T, k) with T = {T}")
    if T == 0:  # no tokens, no routes: nothing to read
        return torch.zeros_like(hidden)
    routes = sort_routes(topk_weights, topk_ids, packed.num_experts, counts)
    x = hidden.contiguous()[routes.token_ids]  # (T * k, H): each route's token, grouped by expert
    I = packed.intermediate_size
    outs = []  # per active expert (n_e, H), in sorted-route order; the inactive experts are never read
    for e, start, end in routes.experts:
        x_e = x[start:end]  # (n_e, H)
        if end - start <= SKINNY_MAX_ROWS:
            h = skinny_gemm(x_e, packed.w13[e], 2 * I)  # (n_e, 2I)
            outs.append(skinny_gemm(silu_and_mul(h), packed.w2[e], H))  # (n_e, H)
        else:
            h = F.linear(x_e, unpack_expert(packed.w13[e], 2 * I))  # (n_e, 2I)
            outs.append(F.linear(silu_and_mul(h), unpack_expert(packed.w2[e], H)))  # (n_e, H)
    y = torch.mul(torch.cat(outs), routes.weights[:, None])  # (T * k, H) float32: each route's output, weighted
    out = torch.zeros(T, H, dtype=torch.float32)
    out.index_add_(0, routes.token_ids, y)  # (T, H): each token's k routes summed in fp32
    return out.to(hidden.dtype)
