"""RMSNorm exactly as HF transformers computes it: normalise in float32, cast back, then scale.

The order matters in fp16/bf16 (scaling before the cast would round differently), and matching it
is what lets the half-precision tests agree with HF. In fp32 there is no cast, so one fused op does it.

`forward(x, residual)` also takes the residual add that comes just before a norm (vLLM's signature):
it returns the normalised `x + residual` and `x + residual` itself, the next residual. On CPU, where
warm-up measured it faster (minivllm/cpu/norm_rope_kernels.py sets `kernels`), both forms run as one pass of minivllm's C++
kernel (kernels/rms_norm.py) instead of a handful of torch ops. Its results equal torch's up to the last
bit of the normaliser (it sums the squares in another order, with fused multiply-adds): in bf16 the same
values but rarely one ulp apart, in fp32 an ulp or two apart in a fifth of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.rms_norm import fused_add_rms_norm, rms_norm
from minivllm.layers.custom_op import KernelSwitch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernels: KernelSwitch | None = None  # set at warm-up where the C++ kernel is faster; None: torch's ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (..., dim) -> normalised (..., dim); with `residual`: (normalised x + residual, x + residual)."""
        if self._kernel_runs(x, residual):
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self.forward_native(x)
        h = residual + x
        return self.forward_native(h), h

    def _kernel_runs(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """The kernel takes what the engine's models give it (one dtype, 2-D or 3-D, no autograd); anything
        else runs torch's ops rather than fail."""
        return (self.kernels is not None and self.kernels.active(x) and x.dim() in (2, 3)
                and self.weight.dtype == x.dtype
                and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim), torch's ops
        if x.dtype == torch.float32:  # no casts to order: one fused op (decode is dispatch-bound)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if x.device.type == "cpu":
            # torch's CPU kernel normalises a half-precision x in float32 and rounds once, so this is
            # bit-identical to the casts below (tests/test_rope_norm.py) in one op instead of three.
            normed = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        else:
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed
