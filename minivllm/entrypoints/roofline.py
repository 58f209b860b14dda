"""How far a benchmark run is from what the machine can do: measured peaks against achieved rates.

    read bandwidth   x.sum() over a float32 buffer of 256 MiB (or larger): bytes read / time, best of 5
    copy bandwidth   copy a 256 MiB buffer (bytes read + bytes written) / time, best of 5
    peak FLOP/s      one 2048 x 2048 x 2048 GEMM in the model's dtype, best of 3
    achieved         a decode step streams every matmul weight once, so
                         bytes/s  = weight bytes x steps / seconds          (a floor on the traffic)
                         FLOP/s   = 2 x (decoder weights x rows computed + LM head weights x rows sampled)
                                    / seconds                               (attention's own FLOPs not counted)

A step with a few rows is bound by bandwidth (2 FLOPs per weight, so a low FLOP/s is expected), a
step with many rows by FLOP/s. The peaks are measured at bench start on the same threads as the run,
so "% of peak" is about this machine as it is now, other jobs included.

The single-stream ceiling. A decode step of one row multiplies every weight once, two FLOPs a weight,
so it waits on memory, and memory only has to *read* the weights (the few activations written are
nothing beside them). Hence the fastest one stream can decode:

    ceiling tok/s = read bandwidth / matmul weight bytes a token        (as stored: int8 is 1 byte)

A sum does one add per 4 bytes read, far less than the vector units can do, so it too waits on memory:
its rate is what a perfect matmul kernel would stream at. The read buffer is at least as large as the
weights a token streams (whichever is larger): a buffer that fits the last-level cache would measure the
cache. A model whose weights fit that cache can still pass the "ceiling" (over 100 %); that is the
cache, not a mistake.

A mixture of experts stores every expert but a token reads only k of each sparse layer's E: the
bytes and FLOPs a token are counted with the top_k/E share of each FusedMoE's w13 + w2 (its k experts),
the params line with all of them (`MatmulWeights.total_params`). The counting is
layers/fused_moe.py's `count_experts`, the same the MoE notebook's decode_bytes uses.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import nn

from minivllm.cpu.cpu_info import CpuInfo
from minivllm.cpu.matmul_forms import default_form, matmul
from minivllm.layers.fused_moe import count_experts
from minivllm.layers.linear import Linear
from minivllm.layers.quantization import Int8LinearMethod


class Peaks(NamedTuple):
    copy_gb_s: float  # bytes read + written a second, copying a 256 MiB buffer
    gemm_gflop_s: float  # a large GEMM in `dtype`
    dtype: torch.dtype
    read_gb_s: float  # bytes read a second: x.sum() over a float32 buffer (measure_read_bandwidth)


class MatmulWeights(NamedTuple):
    """What one token multiplies by: the decoder's matmul weights and the LM head's."""

    decoder_params: int  # a mixture of experts: its k experts a layer, not all E
    lm_head_params: int
    bytes: int  # both, as stored (int8 weights count one byte each, plus their scales)
    idle_expert_params: int = 0  # stored but not read by one token: the other E - k experts a layer

    @property
    def total_params(self) -> int:
        """Every matmul weight the model stores."""
        return self.decoder_params + self.lm_head_params + self.idle_expert_params


def measure_peaks(dtype: torch.dtype, copy_bytes: int = 256 << 20, n: int = 2048,
                  read_bytes: int = 256 << 20) -> Peaks:
    copy_gb_s = measure_copy_bandwidth(copy_bytes)
    read_gb_s = measure_read_bandwidth(read_bytes)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    # In the form the engine multiplies this dtype in when untimed: bf16 where oneDNN takes none is widened
    # to fp32 (cpu/matmul_forms.py); torch's own bf16 GEMM there ran 0.4 GFLOP/s, ~4 minutes for this probe.
    form = default_form(dtype, CpuInfo.read(), n)
    gemm_s = _best(lambda: matmul(a, b, form), 3)
    return Peaks(copy_gb_s, 2 * n ** 3 / gemm_s / 1e9, dtype, read_gb_s)


def measure_copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """GB/s moved (bytes read + bytes written) copying a buffer of `nbytes`, best of `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src), repeats) / 1e9


def measure_read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """GB/s read by `x.sum()` over a float32 buffer of `nbytes`, on torch's threads, best of `repeats`."""
    x = torch.ones(nbytes // 4)  # (nbytes / 4,) float32
    return x.nbytes / _best(lambda: x.sum(), repeats) / 1e9


def single_stream_ceiling(peaks: Peaks, weights: MatmulWeights) -> float:
    """Tokens a second one stream could decode if every token only read its matmul weights once, at the
    measured read bandwidth."""
    return peaks.read_gb_s * 1e9 / weights.bytes


def ceiling_report(cpu: CpuInfo, peaks: Peaks, weights: MatmulWeights, tok_s: float, precision: str) -> str:
    """One line: the single-stream ceiling on this CPU, and the share of it `tok_s` reached."""
    ceiling = single_stream_ceiling(peaks, weights)
    return (f"single-stream ceiling on {cpu.model_name}: read {peaks.read_gb_s:.2f} GB/s / "
            f"{weights.bytes / 1e6:.2f} MB of matmul weights a token ({precision}) = {ceiling:.2f} tok/s; "
            f"reached {tok_s:.2f} tok/s = {100 * tok_s / ceiling:.1f}% of it")


def matmul_weights(model: nn.Module) -> MatmulWeights:
    """The matmul weights one token reads, as stored: every decoder Linear, k experts a sparse layer, the LM head."""
    decoder, decoder_bytes = 0, 0
    for name, m in model.named_modules():
        if name.endswith("lm_head"):
            continue
        if isinstance(m, Linear):  # as stored: an int8 layer keeps its packed weight, not `weight`
            int8 = isinstance(m.quant_method, Int8LinearMethod)
            decoder += m.in_features * m.out_features
            decoder_bytes += Int8LinearMethod.weight_bytes(m) if int8 else m.weight.nbytes
    idle = 0
    if (experts := count_experts(model)) is not None:  # one token: its k experts a sparse layer
        decoder += experts.token_params
        decoder_bytes += experts.token_bytes
        idle = experts.total_params - experts.token_params
    head = model.lm_head_weight
    return MatmulWeights(decoder, head.numel(), decoder_bytes + head.nbytes, idle)


def report(peaks: Peaks, weights: MatmulWeights, seconds: float, steps: int, rows_computed: int,
           rows_sampled: int) -> str:
    """One line: achieved weight bandwidth and matmul FLOP/s against the peaks."""
    gb_s = weights.bytes * steps / seconds / 1e9
    gflop_s = 2 * (weights.decoder_params * rows_computed + weights.lm_head_params * rows_sampled) / seconds / 1e9
    return (f"roofline: weights streamed {gb_s:.1f} GB/s = {100 * gb_s / peaks.copy_gb_s:.0f}% of the measured copy "
            f"bandwidth ({peaks.copy_gb_s:.1f} GB/s), {100 * gb_s / peaks.read_gb_s:.0f}% of the read bandwidth "
            f"({peaks.read_gb_s:.1f} GB/s); matmuls {gflop_s:.1f} GFLOP/s = "
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
