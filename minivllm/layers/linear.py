"""`linear(x, weight, bias)`: y = x W^T + b, with one CPU-specific choice of matmul order.

Decode batches are skinny: a few rows against a weight that does not fit in cache, so a decode step
is bound by how fast the weights stream from memory. On CPU, `F.linear` on 1-64 rows streams them
at ~10 GB/s (MKL's gemv/skinny-gemm paths); computing (W @ x^T)^T instead keeps W in its natural
row-major order and, measured on 2 AMD EPYC cores (torch 2.13, MKL, weights not in cache), reached
24-34 GB/s. One row is the exception that proves the rule: W @ x^T with one column falls back to
gemv, so a single row is duplicated to make two (twice the FLOPs, a third of the time).
Large batches and GPUs use `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_SKINNY_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]  # x: (rows, in_features), weight: (out_features, in_features)
    if x.device.type != "cpu" or rows > _SKINNY_MAX_ROWS:
        return F.linear(x, weight, bias)
    if rows == 1:
        y = (weight @ torch.cat([x, x]).t())[:, :1].t()  # (1, out_features): gemm, not gemv
    else:
        y = (weight @ x.t()).t().contiguous()  # (rows, out_features)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) computed through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
