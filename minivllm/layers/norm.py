"""RMSNorm exactly as HF transformers computes it: normalise in float32, cast back, then scale.

The order matters in fp16/bf16 (scaling before the cast would round differently), and matching it
is what lets the half-precision tests agree with HF. In fp32 there is no cast, so one fused op does it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        if x.dtype == torch.float32:  # no casts to order: one fused op (decode is dispatch-bound)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if x.device.type == "cpu":
            # torch's CPU kernel normalises a half-precision x in float32 and rounds once, so this is
            # bit-identical to the casts below (tests/test_rope_norm.py) in one op instead of three.
            normed = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        else:
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed
