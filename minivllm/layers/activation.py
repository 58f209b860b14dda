"""The gated MLP's activation, silu(gate) * up (vLLM's `SiluAndMul`, in layers/activation.py there too).

A Llama MLP computes gate and up in one product (`gate_up_proj`, (T, 2I)); the activation multiplies
the SiLU of its first half by its second half. In torch that is three kernels and two trips through
memory; minivllm's C++ kernel (kernels/silu_and_mul.py) does it in one pass, with the same rounding. The
MLP holds a `KernelSwitch` (layers/custom_op.py) as `kernels`, set at warm-up where the kernel measured
faster (minivllm/cpu/norm_rope_kernels.py); None: torch's ops.
"""

from __future__ import annotations

import torch

from minivllm.kernels.silu_and_mul import naive_silu_and_mul, silu_and_mul as silu_and_mul_kernel
from minivllm.layers.custom_op import KernelSwitch


def silu_and_mul(gate_up: torch.Tensor, kernels: KernelSwitch | None = None) -> torch.Tensor:
    """gate_up (rows, 2I) -> silu(gate) * up (rows, I); one pass of minivllm's kernel where `kernels` say it
    runs and it takes this tensor, else torch's ops (the same rounding; kernels/silu_and_mul.py)."""
    if kernels is not None and kernels.active(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return silu_and_mul_kernel(gate_up)
    return naive_silu_and_mul(gate_up)
