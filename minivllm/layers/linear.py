"""`linear(x, weight, bias, plan)`: y = x W^T + b, in the matmul form the model's `MatmulPlan` chose.

Decode batches are skinny: a few rows against weights that do not fit in cache, so a decode step is
bound by how fast the weights stream from memory, and on CPU that speed depends on how the product
is computed (x W^T, (W x^T)^T, x W^T with W prepacked for oneDNN, or minivllm's skinny kernel) in a way
that differs from one CPU to the next. `matmul_plan.py` times the forms on the machine at hand during
warm-up; this module only asks the plan. Without a plan, or before it is measured, or on a GPU, every
product is plain `F.linear`. In batch-invariant mode the model hands its layers a `BatchInvariance`
instead of a plan, and every product runs in fixed 16-row tiles (layers/batch_invariance.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.batch_invariance import BatchInvariance, tiled_linear
from minivllm.layers.custom_op import direct_register_custom_op
from minivllm.layers.direct_call import DirectCall
from minivllm.cpu.matmul_forms import MatmulForm, bound_product
from minivllm.cpu.matmul_plan import MatmulPlan

# What a model hands its linear layers: the measured plan, or the batch-invariant mode's fixed tiles.
LinearPlan = MatmulPlan | BatchInvariance


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           plan: LinearPlan | None = None) -> torch.Tensor:  # x (rows, in), weight (out, in) -> (rows, out)
    if isinstance(plan, MatmulPlan) and not torch.compiler.is_compiling():
        return plan.product(weight, bias, x.shape[0])(x)  # the measured form, bound once (matmul_plan.py)
    if isinstance(plan, BatchInvariance):  # before the device check: the tiles are the mode, not a speed-up
        return tiled_linear(x, weight, bias, plan.tile_rows)
    if plan is None or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    # Inside a compiled forward (models/compiled_forward.py) Inductor would choose its own kernel for the
    # product (and cannot see a prepacked weight); an opaque op keeps the kernel the plan measured.
    return torch.ops.minivllm.planned_linear(x, weight, bias, plan.form_for(weight, x.shape[0]).name)


def _planned_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, form: str) -> torch.Tensor:
    return bound_product(weight, bias, MatmulForm[form])(x)  # contiguous, as the fake below promises


def _planned_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, form: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])  # shapes only, for tracing


direct_register_custom_op("planned_linear", _planned_linear_op, _planned_linear_fake)


class Linear(DirectCall, nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) computed through `linear` with the
    model's shared `plan`; called straight through `forward` (layers/direct_call.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 plan: LinearPlan | None = None) -> None:
        super().__init__(in_features, out_features, bias)
        self.plan = plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.plan)
