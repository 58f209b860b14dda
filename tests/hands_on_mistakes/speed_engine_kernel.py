"""Planted cheat (speed, the rule on the engine's kernel): the engine's own kernel imported and called, which would
score its speed, not the student's."""

from __future__ import annotations

import torch

from minivllm.kernels.skinny_gemm import pack_skinny_weight, skinny_gemm


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return pack_skinny_weight(weight)


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return skinny_gemm(x, packed, out_features)
