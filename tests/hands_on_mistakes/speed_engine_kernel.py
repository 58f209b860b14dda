"""Planted cheat (speed, rule 'own kernel'): the engine's own kernel called, which would score its own speed."""

from __future__ import annotations

import torch

from minivllm.kernels.skinny_gemm import pack_skinny_weight, skinny_gemm


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return pack_skinny_weight(weight)


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return skinny_gemm(x, packed, out_features)
