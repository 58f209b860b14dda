"""Planted mistake (speed, rule 'rows 1-8'): rows taken in tiles of 4 and the last, partial tile forgotten
(right for 1-4 and 8 rows, zeros in rows 5-7 of a 7-row call)."""

from __future__ import annotations

import torch

TILE = 4


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()  # (in, out)


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    y = x.new_zeros(x.shape[0], out_features)
    full = x.shape[0] // TILE * TILE if x.shape[0] > TILE else x.shape[0]  # BUG: the remainder tile is dropped
    for start in range(0, full, TILE):
        y[start:start + TILE] = x[start:start + TILE] @ packed
    return y
