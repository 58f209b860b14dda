"""Planted mistake (speed, rule 'bf16 sums'): the running sum kept in x's dtype, so a bf16 product sums in bf16
(right in fp32; in bf16, 8 bits of sum drift by ~0.1 over 1536 terms)."""

from __future__ import annotations

import torch


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()  # (in, out)


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    y = x.new_zeros(x.shape[0], out_features)  # BUG: a bf16 accumulator for bf16 inputs
    for k in range(x.shape[1]):
        y += x[:, k:k + 1] * packed[k]  # (rows, 1) * (out,): rounded to x's dtype at every step
    return y
