"""Planted mistake (speed, rule 'bf16 round once'): k taken in blocks of 64, each block's product summed in fp32
by torch.mm but added to a running sum kept in bf16. On random operands that drifts less than the 'bf16 sums'
tolerance (0.0158 against 0.016 at in = 1536); where partial sums grow large and cancel, it ends 18 off."""

from __future__ import annotations

import torch

BLOCK = 64


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()  # (in, out), x's dtype: half the bytes for bf16


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    y = torch.zeros(x.shape[0], out_features, dtype=x.dtype)  # BUG: a bf16 running sum for bf16 inputs
    for k0 in range(0, x.shape[1], BLOCK):
        y += x[:, k0:k0 + BLOCK] @ packed[k0:k0 + BLOCK]  # (rows, 64) @ (64, out), rounded to bf16 per block
    return y
