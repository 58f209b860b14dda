"""`FusedMoE`: every expert of a sparse layer in two stacked weights, and how its routes are computed.

    w13_weight (E, 2I, H)   per expert e: gate_proj rows [0, I), then up_proj rows [I, 2I)
    w2_weight  (E, H, I)    per expert e: down_proj

    forward(x (T, H), router_logits (T, E)):
        topk_weights, topk_ids = select_experts(router_logits, k, renormalize)     (layers/moe_router.py)
        out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

How the sum is computed is the layer's `moe_method` (vLLM's name), set from outside as a `Linear`'s
`quant_method` is (layers/linear.py), so the model file never changes with the machine:

    TorchMoeMethod   the default: routes sorted by expert, then for each ACTIVE expert only (count > 0) one
                     F.linear over its gathered rows, silu(gate) * up, down, scaled by the route's weight and
                     added back in float32. A decode step of a few tokens reads k experts' weights per token,
                     not all E: that is why a mixture of experts decodes at the speed of its active size.
                     On CUDA, the Triton kernel instead (kernels/fused_moe.py: one grouped matmul over the
                     sorted, block-padded routes, as vLLM's fused_moe).
    CpuMoeMethod     the CPU's packed skinny-GEMM kernels (minivllm/cpu/moe_method.py), attached at warm-up.

Every method computes the contract of `naive_fused_moe` (kernels/fused_moe.py): float32 sums, the output
in x's dtype. Under tensor parallelism I is this rank's share of every expert and the output a partial
sum: the MoE block all-reduces it once (models/qwen3_moe.py). `last_load` keeps the routes per expert of
the last forward, the step's expert load (the engine's stats read it), counted once a forward
(`count_routes`) and handed to the method as `expert_counts`, so no path counts them again. The count adds no
host sync; the default method syncs once per layer (its offsets, to know the active experts) and the
engine once per step (engine/worker/expert_load.py).

`fused_moe_layers(model)` finds a model's sparse layers, for every reader that walks them.

`count_experts(model)` counts a model's experts once for every reader: all of them are stored, but one token
reads only k of each layer's E, so a decode step of one token reads top_k/E of the experts' bytes
(the bench's roofline and single-stream ceiling, entrypoints/roofline.py; the notebook's decode_bytes,
teaching/moe_viz.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.moe_align import count_routes
from minivllm.layers.moe_router import select_experts, sort_tokens_by_expert


class MoeMethodBase(Protocol):
    """How a `FusedMoE` computes its routes: `apply(layer, x (T, H), topk_weights (T, k), topk_ids (T, k))`
    -> (T, H), reading `layer.w13_weight` and `layer.w2_weight`. `expert_counts` (E,): the routes per expert,
    as the layer counted them (None: the method counts them itself)."""

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_counts: torch.Tensor | None = None) -> torch.Tensor: ...


@functools.cache
def _triton_fused_moe() -> Callable[..., torch.Tensor] | None:
    """The CUDA kernel, where Triton (and kernels/fused_moe.py) import; else None."""
    try:
        from minivllm.kernels.fused_moe import fused_moe
    except ImportError:
        return None
    return fused_moe


class TorchMoeMethod(MoeMethodBase):
    """Active experts only, one F.linear pair each (the Triton kernel on CUDA)."""

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_counts: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda and (fused_moe := _triton_fused_moe()) is not None:
            return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        return self.experts_one_by_one(layer, x, topk_weights, topk_ids, expert_counts)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # (n, in), (out, in) -> (n, out)
        """One expert's product over the rows routed to it (the batch-invariant method tiles it)."""
        return F.linear(x, weight)

    def experts_one_by_one(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           expert_counts: torch.Tensor | None = None) -> torch.Tensor:  # x (T, H), topk_* (T, k)
        routes = sort_tokens_by_expert(topk_ids, layer.num_experts, expert_counts)
        weights = topk_weights.flatten()[routes.route_ids]  # (T*k,) each sorted route's weight, float32
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (T, H)
        I = layer.intermediate_size
        offsets = routes.offsets.tolist()  # one host sync: which experts are active, and their rows
        for e in range(layer.num_experts):  # ascending: a token's k outputs are added in one order, always
            start, stop = offsets[e], offsets[e + 1]
            if start == stop:  # not routed to: its weights are never read
                continue
            rows = routes.token_ids[start:stop]  # (n,) the tokens this expert serves
            gate, up = self.linear(x[rows], layer.w13_weight[e]).split(I, dim=-1)  # (n, I) each
            y = self.linear(F.silu(gate) * up, layer.w2_weight[e])  # (n, H)
            out.index_add_(0, rows, y.float() * weights[start:stop, None])
        return out.to(x.dtype)

    def __repr__(self) -> str:
        return "TorchMoeMethod()"


class FusedMoE(nn.Module):
    """E experts of width I (this rank's share) over hidden size H; routes k experts per token."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))  # (E, 2I, H)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))  # (E, H, I)
        self.moe_method: MoeMethodBase = TorchMoeMethod()  # replaced from outside (see the module docstring)
        self.last_load: torch.Tensor | None = None  # (E,) int64 routes per expert of the last forward

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:  # (T, H), (T, E) -> (T, H)
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)  # (T, k) each
        self.last_load = count_routes(topk_ids.flatten(), self.num_experts)  # (E,)
        return self.moe_method.apply(self, x, topk_weights, topk_ids, self.last_load)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, renormalize={self.renormalize}")


class ExpertWeights(NamedTuple):
    """A model's experts, counted: every sparse layer has the same E, k and I (models/moe_config.py)."""
    sparse_layers: int
    num_experts: int  # E a layer
    top_k: int  # k: the experts one token reads a layer
    expert_params: int  # one expert of one layer: w13 (2I x H) + w2 (H x I), this rank's share
    expert_bytes: int  # the same, as stored (a packed layout holds the same weights in another order)

    @property
    def total_params(self) -> int:
        """Every expert of every sparse layer: what the model stores."""
        return self.sparse_layers * self.num_experts * self.expert_params

    @property
    def token_params(self) -> int:
        """What one token reads: its k experts a layer (the top_k/E share of the experts)."""
        return self.sparse_layers * self.top_k * self.expert_params

    @property
    def token_bytes(self) -> int:
        return self.sparse_layers * self.top_k * self.expert_bytes


def fused_moe_layers(model: nn.Module) -> list[FusedMoE]:
    """Every `FusedMoE` of `model`, in module order (layer order for a decoder); [] for a dense model."""
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def count_experts(model: nn.Module) -> ExpertWeights | None:
    """The `FusedMoE` layers of `model` counted (None: a dense model). Works on the meta device (shapes only)."""
    layers = fused_moe_layers(model)
    if not layers:
        return None
    first = layers[0]
    H, I, E = first.hidden_size, first.intermediate_size, first.num_experts
    stored = first.w13_weight.nbytes + first.w2_weight.nbytes  # all E experts of one layer, as stored
    return ExpertWeights(len(layers), E, first.top_k, 3 * I * H, stored // E)
