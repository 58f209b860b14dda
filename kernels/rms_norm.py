"""`rms_norm` and `fused_add_rms_norm`: RMSNorm on CPU in one C++ pass over each row (rms_norm.cpp).

A decoder layer normalises its input twice (before attention, before the MLP), and Qwen3 also each
head of q and k: 33 norms a step for the 8-layer `minivllm bench` model. In bf16 torch computes one as
several kernels: cast to float32, square, mean, add eps, rsqrt, multiply, cast back, multiply by the
weight, each a separate trip through memory with its own dispatch. Measured on 2 cores (AMD EPYC,
32 rows x 384): ~27 µs a norm, ~0.9 ms of a ~7 ms decode step. The C++ kernel reads a row once, sums
its squares in float32, and writes `weight * round(x * r)`: ~8 µs.

The results are HF's, rounding for rounding: normalise in float32, round to the model's dtype, then
multiply by the weight and round again (layers/norm.py explains why that order matters). Only how a
row's squares are summed differs from torch's (another order, fused multiply-adds), which can move the
last bit of r: a bf16 result rarely, an fp32 one by an ulp or two.

`fused_add_rms_norm` is vLLM's op of that name (there it works in place): the residual add that comes
just before the MLP's norm, `h = x + residual`, done in the same pass; it returns the normalised h and
h itself, the next residual.

The references are `naive_rms_norm` and `naive_fused_add_rms_norm`; tests/kernels compare them. RMSNorm
uses the kernel where warm-up measured it faster (minivllm/cpu/norm_rope_kernels.py).
"""

from __future__ import annotations

import torch


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference, HF's order: (..., N) -> (..., N)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def naive_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: h = x + residual; (rms_norm(h), h)."""
    h = x + residual
    return naive_rms_norm(h, weight, eps), h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The C++ kernel (call `load_cpu_kernels()` first). x: (rows, N) or (R1, R2, N), float32 or bfloat16,
    each row's N values contiguous (a view such as qk[:, :Hq] is fine); weight: (N,), x's dtype. Returns a
    new contiguous tensor."""
    return torch.ops.minivllm_cpu.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ kernel: (rms_norm(x + residual), x + residual), both new tensors."""
    return torch.ops.minivllm_cpu.fused_add_rms_norm(x, residual, weight, eps)
