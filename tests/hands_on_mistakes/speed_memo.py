"""Planted mistake (speed, rule 'x refilled'): y cached by x's data pointer, "the same call again". The engine
refills one activation buffer every step, so the second call returns the previous step's answer; timed on one
x, this cache also made the track report 51667 % of the machine's read bandwidth (a student's find)."""

from __future__ import annotations

import torch

_cache: dict = {}


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.float().t().contiguous()  # (in, out), fp32


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    key = (x.data_ptr(), x.shape, x.dtype, packed.data_ptr())  # BUG: the pointer, not the values
    y = _cache.get(key)
    if y is None:
        y = _cache[key] = torch.mm(x.float(), packed).to(x.dtype)  # (rows, out)
    return y
