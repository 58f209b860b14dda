"""`skinny_gemm`: y = x W^T + b for a few rows of x on CPU, as one pass over a re-laid-out weight.

A decode step multiplies 1-16 rows by every weight of the model, so it is bound by streaming the
weights from memory: each weight byte is used once per row. On 2 AMD EPYC cores torch's kernels
streamed a bf16 weight at 11-21 GB/s (`F.linear` / oneDNN's packed weight) where a plain `sum()`
reads the same bytes at 40-55 GB/s. Two things cost the difference:

  * row-major W (out, in) makes every output a dot product of two long vectors, which ends in a
    horizontal sum of a 16-lane register. With in = 576 that sum costs as much as the loop before it.
  * a weight of a few hundred KB is over before the hardware prefetchers are up to speed unless the
    kernel reads it as ONE sequential stream.

So `pack_skinny_weight` lays W out in blocks of 16 output columns, each block contiguous (the C++
file's header draws it), and the kernel broadcasts `x[m][k]` against a 16-wide slice of W: 16 outputs
advance per load, no horizontal sums, one front-to-back read of the weight per call, shared by up to
8 rows (speculative decoding verifies 1 + k rows, k drafts: 5 rows read what 1 row reads). bf16 weights
are paired along k so one AVX-512 BF16 dot-product instruction does 32 MACs; without it (AVX2, AVX-512
without BF16) a pair is widened to fp32 by a shift in registers. `skinny_gemm_tiling` says how this
build tiles a number of rows into the register file (the notebooks print it).

The C++ (skinny_gemm.cpp, beside this file) is compiled on first use for the machine that runs it, with
the other CPU kernels (kernels/cpu_build.py). Where it cannot be built, `load_cpu_kernels` says why,
the matmul plan's summary repeats it, and the plan simply does not offer the form (layers/matmul_plan.py).

`naive_skinny_gemm` is the plain-PyTorch reference (fp32 accumulation); tests/kernels compare them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

LANES = 16  # output columns per block (one AVX-512 register of fp32)


def naive_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: x (rows, in) @ weight (out, in)^T + bias, accumulated in fp32, rounded to x's dtype."""
    y = x.float() @ weight.float().t()  # (rows, out)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_skinny_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in) -> blocks of 16 output columns: fp32 (ceil(out/16), in, 16); bf16
    (ceil(out/16), in/2, 16, 2), k paired. Rows past `out` are zero padding (never written out).

    It runs for every weight at every start, so it copies the weight once: padding only when out is
    not a multiple of 16 (never in SmolLM2), and a bf16 k pair moved as one int32 (one 4-byte element
    per move instead of two 2-byte ones: about 3x faster, the same bytes)."""
    out_features, in_features = weight.shape
    if not (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and in_features % 2 == 0)):
        raise ValueError(f"skinny_gemm packs float32, or bfloat16 with an even in_features; got {weight.dtype} "
                         f"({out_features} x {in_features})")
    n_blocks = math.ceil(out_features / LANES)
    w = weight.detach().contiguous()  # (out, in)
    if weight.dtype == torch.bfloat16 and w.storage_offset() % 2:  # a view at an odd offset: no int32 view of it
        w = w.clone()
    if n_blocks * LANES != out_features:
        w = F.pad(w, (0, 0, 0, n_blocks * LANES - out_features))  # (n_blocks * 16, in)
    if weight.dtype == torch.bfloat16:  # (n_blocks * 16, in / 2) k pairs, as int32 -> (n_blocks, in / 2, 16)
        pairs = w.view(torch.int32).view(n_blocks, LANES, in_features // 2).transpose(1, 2).contiguous()
        return pairs.view(torch.bfloat16).view(n_blocks, in_features // 2, LANES, 2)
    return w.view(n_blocks, LANES, in_features).transpose(1, 2).contiguous()


def can_pack_skinny(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and (
        weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0))


def skinny_gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) times the weight packed by `pack_skinny_weight` -> (rows, out_features), + bias.
    Call `load_cpu_kernels()` (kernels/cpu_build.py) first; it must say available."""
    return torch.ops.minivllm_cpu.skinny_gemm(x, packed, out_features, bias)


class SkinnyTiling(NamedTuple):
    """How the compiled kernel walks `rows` rows of x: `rows_per_pass` rows share one read of the weight
    (`passes` reads in all); each tile keeps `columns` x rows accumulators of `lanes` fp32 lanes in registers,
    `registers_used` of the `registers` the build's ISA has (the portable loop has no register file: 1024)."""

    rows_per_pass: int
    passes: int
    columns: int
    lanes: int
    registers_used: int
    registers: int


def skinny_gemm_tiling(rows: int, dtype: torch.dtype) -> SkinnyTiling:
    """The tiling of this process's build (AVX-512, AVX2 or portable) for `rows` rows of `dtype` weights, at the
    first pass's row count. Call `load_cpu_kernels()` first."""
    return SkinnyTiling(*torch.ops.minivllm_cpu.skinny_gemm_tiling(rows, dtype == torch.bfloat16))
