"""`greedy_argmax`: each row's argmax, read straight from the model's bf16 (or fp32) logits on CPU.

A greedy request's next token is the argmax of its logits row: 32 000 numbers for the `minivllm bench`
model, 49 152 for SmolLM2. torch's way costs more than it looks on CPU. Its argmax along a row is not
vectorised, so the sampler cuts rows into blocks (`argmax_rows`, layers/sampler.py). It also needs
float32 logits, and copying a bf16 model's logits to float32 allocates a fresh buffer every step.
Measured inside a 32-row bf16 decode step of the bench model, the copy and the argmax took ~360 µs,
about 4 % of the step.

The C++ kernel (greedy_argmax.cpp, beside this file) reads each row once, in its own dtype, 16 lanes
at a time; each lane keeps its largest value and where it was. It allocates nothing but the (S,)
result. It follows torch.argmax's rules: the first index of the maximum, and the first NaN if the row
has one. `Sampler` uses it for all-greedy steps where warm-up measured it faster
(minivllm/cpu/decode_kernels.py `choose_greedy_kernel`).

`naive_greedy_argmax` is the reference; tests/kernels compare them.
"""

from __future__ import annotations

import torch


def naive_greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Reference: (S, V) -> (S,) int64, torch.argmax over the float32 values."""
    return logits.float().argmax(-1)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The compiled kernel (call `load_cpu_kernels()` first). logits: (S, V) float32 or bfloat16, each row
    contiguous."""
    return torch.ops.minivllm_cpu.greedy_argmax(logits)
