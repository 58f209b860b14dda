"""Batch invariance: the mode in which a request's numbers do not depend on the requests beside it.

Floating-point addition is not associative: (a + b) + c and a + (b + c) may differ in the last bit.
A matrix product's every output is a long sum, and the library that computes it (oneDNN or MKL on a
CPU, cuBLAS on a GPU) picks its kernel, its blocking and so the order of that sum from the shape of
the call, above all from M, the number of rows. In a batched engine M is "how many tokens of all
requests share this step", so the same token of the same request can come out of `F.linear` one ulp
apart depending on who else was scheduled; an ulp in a logit is enough, once in a while, to flip a
greedy argmax, and from there the texts diverge. (On this CPU, fp32 `F.linear` gives a row other bits
at M = 1, 2, 3, 5 and 8 than within 16 rows: docs/concepts/batch-invariance.md shows it.)

The mode (`EngineConfig.batch_invariant`, vLLM's VLLM_BATCH_INVARIANT) removes every such dependence:

  * matmuls: `tiled_linear` multiplies in fixed tiles of `tile_rows` (16) rows, the last tile padded
    with zeros, each tile one `F.linear` call. Every call has the same shape, so the library runs the
    same kernel with the same blocking on every tile, and a row's sum is computed in one order
    wherever the row sits (its position in the tile does not matter: the reduction runs along the
    inner dimension, per output, the same for every row; tests/test_batch_invariance.py checks it bit
    for bit). No measured form (cpu/matmul_plan.py) is used: a choice by timing could differ from
    one process to the next.
  * attention: every row, prefill rows too, is a one-row query over its own context
    (layers/per_row_attention.py), so a prompt gives the same bits however it was chunked.
  * RMSNorm, RoPE and greedy argmax run one fixed path (torch's ops; float32 argmax): they are per row
    by nature, and nothing is timed, so nothing can choose differently.
  * eager only: a compiled graph pads a step to a size and Inductor picks kernels per size.
  * a mixture of experts (layers/fused_moe.py): an expert multiplies the rows routed to it, and how many that
    is depends on the whole batch (a decode row alone is 1 row for each of its k experts; beside 15 others,
    maybe 5). Its products are tiled too (`TiledMoeMethod`). The rest is already per row: the router is a
    `Linear` (tiled), softmax and top-k run along each row, silu(gate) * up is elementwise, and a token's k
    weighted outputs are added into a float32 zero in ascending expert order, whoever else was routed. (The
    CPU's packed experts, cpu/moe_method.py, are never attached: warm-up measures and attaches nothing here.)

`TiledLinearMethod` is the mode's matmul, a linear method (layers/linear.py), and `TiledMoeMethod` its experts'
(a `FusedMoE`'s moe_method); `set_batch_invariant_methods` gives every `Linear` and every `FusedMoE` of the model
theirs when the engine loads it (engine/worker/loading.py): the model is built as always, no global switch.
The engine refuses the mode where it is not shown to hold (config.py): CUDA, tensor parallelism, hybrid models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.fused_moe import FusedMoE, TorchMoeMethod, fused_moe_layers
from minivllm.layers.linear import LinearMethodBase, set_linear_method

TILE_ROWS = 16


@dataclass(frozen=True)
class TiledLinearMethod(LinearMethodBase):
    """A `Linear`'s product in fixed tiles of `tile_rows` rows (`tiled_linear`), whatever the step's size."""

    tile_rows: int = TILE_ROWS

    def __post_init__(self) -> None:
        if self.tile_rows < 1:
            raise ValueError(f"tile_rows={self.tile_rows} must be a positive number of rows")

    def summary(self) -> str:
        return (f"matmul: F.linear over fixed tiles of {self.tile_rows} rows (batch_invariant=True: "
                "nothing measured, one kernel for every row)")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return tiled_linear(x, layer.weight, bias, self.tile_rows)  # (rows, in) -> (rows, out)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tile_rows: int = TILE_ROWS) -> torch.Tensor:  # x (rows, in), weight (out, in) -> (rows, out)
    """y = x W^T + b, computed `tile_rows` rows at a time, each tile one `F.linear` of the same shape.

    The last tile is padded with zero rows (their outputs are dropped), so a step of 3 rows costs as
    much as one of 16: that padding, and one call per tile for long prefills, is the mode's price for
    matmuls."""
    rows = x.shape[0]
    padded = -(-rows // tile_rows) * tile_rows  # rows rounded up to whole tiles
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])  # (padded, in)
    else:
        x = x.contiguous()  # a strided view would make F.linear copy or take another path
    out = x.new_empty(padded, weight.shape[0])  # (padded, out)
    for start in range(0, padded, tile_rows):
        out[start:start + tile_rows] = F.linear(x[start:start + tile_rows], weight, bias)  # (tile, out)
    return out[:rows]


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain product `tiled_linear` must equal up to rounding (not bit for bit: its M differs)."""
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class TiledMoeMethod(TorchMoeMethod):
    """A `FusedMoE`'s experts as TorchMoeMethod computes them on CPU (layers/fused_moe.py: the active experts
    only, in ascending order), each one's products over its rows in fixed tiles (`tiled_linear`), so a row's bits
    never depend on how many other rows its expert serves in the step. Never the Triton kernel: its blocks of
    sorted routes are sized by the batch."""

    tile_rows: int = TILE_ROWS

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_counts: torch.Tensor | None = None) -> torch.Tensor:  # x (T, H), topk_* (T, k) -> (T, H)
        return self.experts_one_by_one(layer, x, topk_weights, topk_ids, expert_counts)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # (n, in), (out, in) -> (n, out)
        return tiled_linear(x, weight, None, self.tile_rows)


def set_batch_invariant_methods(model: nn.Module, tile_rows: int = TILE_ROWS) -> None:
    """The mode's methods on `model`: `TiledLinearMethod` on every `Linear` (and a tied LM head), `TiledMoeMethod`
    on every `FusedMoE`."""
    set_linear_method(model, TiledLinearMethod(tile_rows))
    for layer in fused_moe_layers(model):
        layer.moe_method = TiledMoeMethod(tile_rows)
