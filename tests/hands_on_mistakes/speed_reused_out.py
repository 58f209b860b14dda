"""Planted mistake (speed, rule 'results kept'): one output buffer per shape, returned by every call, "no
allocation in the hot loop". The engine still holds the previous result when it calls again, and that result
silently becomes the new one."""

from __future__ import annotations

import torch

_out: dict = {}


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.float().t().contiguous()  # (in, out), fp32


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    key = (x.shape[0], out_features)
    if key not in _out:
        _out[key] = torch.empty(x.shape[0], out_features)  # (rows, out), fp32
    buf = torch.mm(x.float(), packed, out=_out[key])  # BUG: every call writes the same tensor
    return buf if x.dtype == torch.float32 else buf.to(x.dtype)
