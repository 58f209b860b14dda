"""Hands-on 5, speed: the few-row matmul a decode step runs for every weight of the model, as fast as the CPU reads.

A decode step multiplies x, a few rows of activations (one per request; 1 + k for a speculative verify, so
rows <= 8), by every weight W (out_features, in_features) of the model:

    y = x @ W^T          x (rows, in), W (out, in)  ->  y (rows, out)        y[m][n] = sum_k x[m][k] * W[n][k]

Each weight byte is used once per row, so the product is bound by READING W: with 1-8 rows a CPU can do the
arithmetic far faster than its memory delivers the weight. The time to aim for is weight bytes / the read
bandwidth; the track measures both and plots your kernel against that roof and the engine's own
(kernels/skinny_gemm.py and .cpp: read their docstrings once yours is correct).

Write two functions:
  * pack_weight(weight) -> packed: called ONCE per weight, untimed (the engine packs at load time). Lay W
    out however your loop wants to read it: e.g. W^T contiguous, or blocks of 16 output columns. The
    starter returns W unchanged.
  * few_row_matmul(x, packed, out_features) -> y: timed. x's dtype is float32 or bfloat16 (W's is the
    same); y is x's dtype, (rows, out_features). Sum in fp32 even for bf16, rounding once at the end.
    x is contiguous (row-major: x[m][k] at m * in + k), as every Linear's input in the engine is, so C++ may
    read it through x.data_ptr(). Compute every call from x as it is now (the engine refills the same x
    buffer every step: no cached results) and return a new tensor each time (the engine still holds the
    last result: no output buffer reused across calls).

Plain torch is fine; so is C++ through torch.utils.cpp_extension.load_inline (AVX2 + FMA intrinsics run on
every student's x86-64 laptop; README.md beside this file sketches one). The engine's own kernel
(skinny_gemm, torch.ops.minivllm_cpu) is off limits: the grader refuses a file whose code names it.

Grade:  python -m minivllm.teaching.perf_speed exercises/hands_on/5_speed/my_speed.py        (correctness)
Time:   python -m minivllm.teaching.perf_track speed exercises/hands_on/5_speed/my_speed.py
        (correctness first, then yours and the engine's in alternating fresh processes, medians: the ratio,
        the fraction of the read bandwidth; the roofline saved as roofline.png beside this file;
        docs/performance-track.md)
"""

from __future__ import annotations

import torch


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # (out, in) -> whatever few_row_matmul reads
    """Once per weight, untimed: the layout your loop reads. Unchanged is a correct start."""
    return weight


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (rows, in) times the weight packed by `pack_weight` -> (rows, out_features), in x's dtype."""
    raise NotImplementedError
