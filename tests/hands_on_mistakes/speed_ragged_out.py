"""Planted mistake (speed, rule 'ragged out'): W packed in blocks of 16 output columns, and only whole blocks
computed (out_features 40 leaves its last 8 columns at zero)."""

from __future__ import annotations

import torch

LANES = 16


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    blocks = weight.shape[0] // LANES  # BUG: floor, not ceil (and no padding of the last block)
    return weight[:blocks * LANES].view(blocks, LANES, -1).transpose(1, 2).contiguous()  # (blocks, in, 16)


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    y = x.new_zeros(x.shape[0], out_features)
    for b in range(packed.shape[0]):
        y[:, b * LANES:(b + 1) * LANES] = x @ packed[b]  # (rows, in) @ (in, 16)
    return y
