"""Planted mistake (speed, rule 'one row'): W's storage read as an (in, out) matrix, as if it were W^T already.
The shapes fit, so nothing crashes; every value is wrong."""

from __future__ import annotations

import torch


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x @ packed.reshape(x.shape[1], out_features)  # (rows, in) @ (in, out): W's bytes in the wrong order
