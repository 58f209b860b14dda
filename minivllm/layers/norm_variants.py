"""Two RMSNorm variants of the Qwen3-Next / Qwen3.5 family, exactly as HF transformers computes them.

    ZeroCenteredRMSNorm   y = rms_normalise(x) * (1 + w)          the stored weight w starts at 0
    GatedRMSNorm          y = (w * rms_normalise(x)) * silu(z)     normalise first, then gate

The first is every norm of a Qwen3.5 decoder (input / post-attention / final, and the per-head q/k
norms): storing w - 1 instead of w keeps weight decay from pulling the scale towards 0. Loading its
weight into a plain `RMSNorm` silently scales every activation by ~0: the checkpoint name is the same.

The second closes a gated-DeltaNet layer: each value head's output is normalised, then gated by
z = in_proj_z(x), a second projection of the layer's input (the linear-attention analogue of the
full-attention layer's output gate).

Orders of casts follow HF in half precision: (normed * (1 + w)) is cast back after the product here,
unlike `norm.RMSNorm` (Llama's order), which casts before scaling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # x, gate (..., dim) -> (..., dim)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)
