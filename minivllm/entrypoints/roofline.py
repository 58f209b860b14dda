"""How far a benchmark run is from what the machine can do: measured peaks against achieved rates.

    peak bandwidth   copy a 256 MiB buffer (bytes read + bytes written) / time, best of 5
    peak FLOP/s      one 2048 x 2048 x 2048 GEMM in the model's dtype, best of 3
    achieved         a decode step streams every matmul weight once, so
                         bytes/s  = weight bytes x steps / seconds          (a floor on the traffic)
                         FLOP/s   = 2 x (decoder weights x rows computed + LM head weights x rows sampled)
                                    / seconds                               (attention's own FLOPs not counted)

A step with a few rows is bound by bandwidth (2 FLOPs per weight, so a low FLOP/s is expected), a
step with many rows by FLOP/s. Both peaks are measured at bench start on the same threads as the run,
so "% of peak" is about this machine as it is now, other jobs included.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import nn

from minivllm.layers.linear import Linear
from minivllm.layers.quantization import Int8Linear


class Peaks(NamedTuple):
    copy_gb_s: float
    gemm_gflop_s: float
    dtype: torch.dtype


class MatmulWeights(NamedTuple):
    """What one decode step multiplies by: the decoder's matmul weights and the LM head's."""

    decoder_params: int
    lm_head_params: int
    bytes: int  # both, as stored (int8 weights count one byte each, plus their scales)


def measure_peaks(dtype: torch.dtype, copy_bytes: int = 256 << 20, n: int = 2048) -> Peaks:
    src = torch.ones(copy_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), 5)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    gemm_s = _best(lambda: a @ b, 3)
    return Peaks(2 * copy_bytes / copy_s / 1e9, 2 * n ** 3 / gemm_s / 1e9, dtype)


def matmul_weights(model: nn.Module) -> MatmulWeights:
    decoder, decoder_bytes = 0, 0
    for name, m in model.named_modules():
        if name.endswith("lm_head"):
            continue
        if isinstance(m, Linear):
            decoder, decoder_bytes = decoder + m.weight.numel(), decoder_bytes + m.weight.nbytes
        elif isinstance(m, Int8Linear):
            decoder, decoder_bytes = decoder + m.in_features * m.out_features, decoder_bytes + m.weight_bytes
    head = model.lm_head_weight
    return MatmulWeights(decoder, head.numel(), decoder_bytes + head.nbytes)


def report(peaks: Peaks, weights: MatmulWeights, seconds: float, steps: int, rows_computed: int,
           rows_sampled: int) -> str:
    """One line: achieved weight bandwidth and matmul FLOP/s against the peaks."""
    gb_s = weights.bytes * steps / seconds / 1e9
    gflop_s = 2 * (weights.decoder_params * rows_computed + weights.lm_head_params * rows_sampled) / seconds / 1e9
    return (f"roofline: weights streamed {gb_s:.1f} GB/s = {100 * gb_s / peaks.copy_gb_s:.0f}% of the measured copy "
            f"bandwidth ({peaks.copy_gb_s:.1f} GB/s); matmuls {gflop_s:.1f} GFLOP/s = "
            f"{100 * gflop_s / peaks.gemm_gflop_s:.0f}% of a large {str(peaks.dtype).removeprefix('torch.')} GEMM "
            f"({peaks.gemm_gflop_s:.0f} GFLOP/s); {weights.bytes / 1e6:.0f} MB of matmul weights a step")


def _best(fn, repeats: int) -> float:
    fn()  # first touch: page faults and kernel selection are not the machine's peak
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
