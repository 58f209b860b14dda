"""`PlannedLinearMethod`: a `Linear`'s product in the form its model's `MatmulPlan` measured fastest here.

The layers multiply through a linear method (layers/linear.py: `layer.quant_method.apply(layer, x,
bias)`); this is the CPU's, attached to every `Linear` of a model at warm-up (cpu/attach.py) once the
plan is measured or read from the tuning cache. It asks the plan for the product bound to this weight
and row count (matmul_plan.py `product`: bound once per (weight, rows) for decode sizes).

Inside a compiled forward (models/compiled_forward.py) Inductor would choose its own kernel for the
product (and cannot see a prepacked weight), so there the product is an opaque op,
`minivllm::planned_linear`, that runs the form the plan measured.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.cpu.matmul_forms import MatmulForm, bound_product
from minivllm.cpu.matmul_plan import MatmulPlan
from minivllm.layers.custom_op import direct_register_custom_op


class PlannedLinearMethod:
    """A linear method (layers/linear.py's `LinearMethodBase`, by its `apply`) that runs `plan`'s forms."""

    def __init__(self, plan: MatmulPlan) -> None:
        self.plan = plan  # shared by every layer of one model

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight  # (out, in); x (rows, in) -> (rows, out)
        if not torch.compiler.is_compiling():
            return self.plan.product(weight, bias, x.shape[0])(x)  # the measured form, bound once
        if x.device.type != "cpu":
            return F.linear(x, weight, bias)
        return torch.ops.minivllm.planned_linear(x, weight, bias, self.plan.form_for(weight, x.shape[0]).name)

    def __repr__(self) -> str:
        return f"PlannedLinearMethod({self.plan.source})"


def planned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: MatmulPlan) -> torch.Tensor:
    """x (rows, in) times `weight` (out, in) as `plan` says: what a layer with this plan's method computes."""
    return PlannedLinearMethod(plan).apply(_Weight(weight), x, bias)


class _Weight(NamedTuple):  # what `apply` reads of a layer
    weight: torch.Tensor


def _planned_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, form: str) -> torch.Tensor:
    return bound_product(weight, bias, MatmulForm[form])(x)  # contiguous, as the fake below promises


def _planned_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, form: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])  # shapes only, for tracing


direct_register_custom_op("planned_linear", _planned_linear_op, _planned_linear_fake)
