"""`rotary_embedding`: RoPE on CPU in one C++ pass over a step's heads (rotary_embedding.cpp).

The PyTorch form (layers/rotary.py, `rotate`) looks each row's position up in the cos / sin tables once
a step, then runs four kernels per tensor it rotates (a flip, two multiplies, an add), each over the
whole (T, H, D) tensor. Qwen3 rotates q and k apart, after their norms: 16 rotations a step of the 8-layer
`minivllm bench` model, ~25-40 µs each at 1-32 rows in bf16 on 2 cores. The C++ kernel reads each head
once, takes cos and sin straight from the float32 tables at the row's position (no lookup, no copy) and
writes the rotated head: ~6-10 µs.

It computes exactly what `rotate` does, rounding for rounding: the table entries are rounded to x's
dtype as `lookup` rounds them, and each product and the sum are rounded as torch rounds them (no fused
multiply-add), so the results are bit-identical in float32 and bfloat16 (tested).

The reference is `naive_rotary_embedding`; tests/kernels compare them. The model uses the kernel where
warm-up measured it faster (minivllm/cpu/norm_rope_kernels.py).
"""

from __future__ import annotations

import torch


def naive_rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
                           ) -> torch.Tensor:
    """Reference: x (T, H, D) rotated by the tables' rows at `positions` (T,); tables (P, D) float32, sin's
    first half negated. x * cos + swap_halves(x) * sin, in x's dtype."""
    c = cos[positions].unsqueeze(1).to(x.dtype)  # (T, 1, D)
    s = signed_sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((x2, x1), dim=-1) * s


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
                     ) -> torch.Tensor:
    """The C++ kernel (call `load_cpu_kernels()` first). x: (T, H, D) float32 or bfloat16, each head's D
    values contiguous (any row / head stride); positions: (T,) int64; cos, signed_sin: (P, D) float32,
    contiguous. Returns a new contiguous (T, H, D) tensor."""
    return torch.ops.minivllm_cpu.rotary_embedding(x, positions, cos, signed_sin)
