"""Reference solution, hands-on 5: the few-row matmul y = x W^T in plain torch, weight read as one stream (graded
by `python -m minivllm.teaching.perf_speed tests/hands_on_solutions/speed.py`, timed by `... perf_track speed`).

Packing W once as W^T, (in, out) contiguous, turns the product into "for each k, add x[:, k] times row k of
W^T": one front-to-back read of the weight, every row of x sharing it, no horizontal sums (the layout the
engine's skinny_gemm packs into, 16 columns at a time). torch's matmul runs it in fp32 accumulators, also for
bf16 operands. Kept out of the student's way; tests/test_perf_track.py grades it and plants mistakes beside it
(tests/hands_on_mistakes/speed_*.py)."""

from __future__ import annotations

import torch


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W (out, in) -> W^T (in, out), contiguous: row k holds every output's k-th weight."""
    return weight.t().contiguous()


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (rows, in) @ W^T (in, out) -> (rows, out), in x's dtype."""
    return torch.mm(x, packed)  # (rows, out_features)
