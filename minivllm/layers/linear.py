"""`Linear`: y = x W^T + b, computed by the layer's `quant_method` (vLLM's name and shape).

A model builds plain `Linear` layers: `nn.Linear`'s parameters and checkpoint names, and one line of
forward, `self.quant_method.apply(self, x, self.bias)`. How the product is computed is not the layer's
business; it is an object set on the layer from outside, after the model is built:

    UnquantizedLinearMethod   F.linear: the default (a GPU, before warm-up, a test that builds a model)
    the CPU plan's method     the matmul form measured fastest for this weight and row count on this
                              machine (minivllm/cpu/planned_linear.py), attached at warm-up
    TiledLinearMethod         batch_invariant=True: fixed 16-row tiles (layers/batch_invariance.py)
    Int8LinearMethod          quantization="int8": the weight packed in int8 on the layer, fbgemm's
                              product (layers/quantization.py), set at load

Every method computes the same y = x W^T + b (up to rounding; int8 up to its quantization error), so
swapping one never changes what the model means, only how fast (or, for the tiles, in which order each
sum is added). The layer is an ordinary `nn.Module`: forward hooks, pre-hooks and `module.compile()`
work on it as on any other.

`LinearMethodBase` is a Protocol: anything with `apply(layer, x, bias)` serves, so minivllm/cpu/ can
provide a method without this module knowing it (the imports point cpu -> layers, never back).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethodBase(Protocol):
    """How a linear layer multiplies: `apply(layer, x (rows, in), bias)` -> (rows, out), reading `layer.weight`."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


class UnquantizedLinearMethod(LinearMethodBase):
    """The plain product, `F.linear`."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)  # (rows, in) -> (rows, out)

    def __repr__(self) -> str:
        return "UnquantizedLinearMethod()"


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) computed through its `quant_method`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.quant_method: LinearMethodBase = UnquantizedLinearMethod()  # replaced from outside (see above)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return self.quant_method.apply(self, x, self.bias)


def set_linear_method(model: nn.Module, method: LinearMethodBase) -> int:
    """Give every layer of `model` that multiplies through a `quant_method` (each `Linear`, and an embedding
    that serves as the tied LM head) `method`; returns how many."""
    layers = [m for m in model.modules() if hasattr(m, "quant_method")]
    for layer in layers:
        layer.quant_method = method
    return len(layers)
