"""`silu_and_mul`: the MLP's activation on CPU, silu(gate) * up, in one C++ pass (silu_and_mul.cpp).

A Llama-family MLP is `down(silu(gate) * up)`, with gate and up computed by one packed matmul
(`gate_up_proj`, vLLM's packing) into a (rows, 2I) tensor. Between the two matmuls torch runs a split
(a view), `silu` (a pass writing a new (rows, I) tensor) and the product (another pass, another
tensor): two dispatches from Python and three trips through memory, a step's worth of which cost about as
much as the norms did before their kernel (kernels/rms_norm.py). vLLM's CPU backend has an op of the same
name for the same reason. This one reads each row's gate and up once and writes the product once.

The result is torch's, rounding for rounding: silu(g) = g / (1 + e^-g) in float32, rounded to the model's
dtype (F.silu returns it), then multiplied by up and rounded again. Only e^-g is computed another way (a
polynomial shared with the decode-attention kernel, kernels/cpu_simd.h): an fp32 result can differ from
torch's in its last bit or two, a bf16 one rarely by one ulp.

The reference is `naive_silu_and_mul`; tests/kernels compare them. The MLP uses the kernel where
warm-up measured the model's element-wise kernels faster (minivllm/cpu/norm_rope_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Reference, torch's two ops: x (rows, 2I) -> silu(x[:, :I]) * x[:, I:], (rows, I)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The C++ kernel (call `load_cpu_kernels()` first). x: (rows, 2I), float32 or bfloat16, each row's
    values contiguous (any row stride). Returns a new contiguous (rows, I) tensor."""
    return torch.ops.minivllm_cpu.silu_and_mul(x)
