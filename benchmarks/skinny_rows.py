"""Few-row matmul on CPU: what `skinny_gemm` costs at 1-16 rows, against `F.linear` and the read-bandwidth
ceiling (a benchmark, never a test: timings depend on the machine and its load).

A decode step multiplies 1 row per sequence by every weight; speculative decoding's verify step multiplies
1 + k rows (k drafts, typically 2-6). Both are bound by reading the weight, so a 5-row product should cost
about what a 1-row one does: the line to read is `rows5/rows1`.

    time per call   fastest round of (one pass over a rotating set of weights) / weights in the set: the
                    kernel's own cost; a busy machine only adds to it (compare ratios, not absolute times)
    GB/s            weight bytes / time per call (x and y are tiny next to the weight)
    of ceiling      GB/s / the read bandwidth of a big `torch.sum` (>= 256 MiB) in this process

The weights rotate through a set of >= 2x L3 (64 MiB by default), so every call reads its weight from
memory, as a model's forward does; a single weight timed in a loop would sit in cache and the numbers lie.
Shapes are SmolLM2-135M's (hidden 576, kv 192, intermediate 1536, vocab 49152).

    python benchmarks/skinny_rows.py [--dtypes float32 bfloat16] [--rows 1 2 4 5 6 8 16] [--shapes qo lm_head]
    MINIVLLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/skinny_rows.py        # as an AVX2 laptop runs it (the kernel built for x86-64-v3)

Every line starts with the ISA level (minivllm's and torch's).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from minivllm.kernels.cpu_build import isa_level, load_cpu_kernels
from minivllm.kernels.skinny_gemm import pack_skinny_weight, skinny_gemm

SHAPES = {  # name: (out_features, in_features), SmolLM2-135M
    "qo": (576, 576), "kv": (192, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RowFigures:
    """One (shape, dtype, rows): microseconds per call of each form, and the kernel's GB/s."""

    isa: str
    shape: str
    dtype: str
    rows: int
    skinny_us: float
    linear_us: float
    skinny_gbps: float
    of_ceiling: float  # skinny_gbps / read bandwidth
    of_rows1: float  # skinny time / its time at 1 row (the same run)


def read_bandwidth(mib: int = 512, rounds: int = 7, clock: Callable[[], float] = time.perf_counter) -> float:
    """GB/s of `torch.sum` over a `mib` MiB fp32 tensor: the reading speed a weight-bound kernel can hope for."""
    big = torch.ones(mib << 18)  # (mib MiB / 4 bytes,)
    big.sum()  # first touch
    times = []
    for _ in range(rounds):
        start = clock()
        big.sum()
        times.append(clock() - start)
    return big.numel() * 4 / min(times) / 1e9


def time_per_call(call: Callable[[int], object], count: int, rounds: int, clock: Callable[[], float]) -> float:
    """The fastest of `rounds` rounds, in seconds per call, one call for each of the `count` weights a round."""
    call(0)  # warm-up (first call of a shape allocates)
    times = []
    for _ in range(rounds):
        start = clock()
        for i in range(count):
            call(i)
        times.append((clock() - start) / count)
    return min(times)


def rotating_weights(out_f: int, in_f: int, dtype: torch.dtype, set_bytes: int) -> list[torch.Tensor]:
    """Enough distinct (out_f, in_f) weights to total >= set_bytes (at least 2)."""
    one = out_f * in_f * torch.finfo(dtype).bits // 8
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(dtype)
            for _ in range(max(2, -(-set_bytes // one)))]


def measure(shape: str, dtype_name: str, rows: list[int], ceiling: float, set_bytes: int, rounds: int,
            op: Callable = skinny_gemm, clock: Callable[[], float] = time.perf_counter) -> list[RowFigures]:
    out_f, in_f = SHAPES[shape]
    dtype = DTYPES[dtype_name]
    weights = rotating_weights(out_f, in_f, dtype, set_bytes)
    packed = [pack_skinny_weight(w) for w in weights]
    nbytes = weights[0].numel() * weights[0].element_size()
    isa = f"{isa_level()}/{torch.backends.cpu.get_cpu_capability()}"
    figures, first = [], None
    for r in rows:
        x = torch.randn(r, in_f).to(dtype)
        skinny = time_per_call(lambda i: op(x, packed[i], out_f, None), len(packed), rounds, clock)
        linear = time_per_call(lambda i: F.linear(x, weights[i]), len(weights), rounds, clock)
        first = first or skinny
        gbps = nbytes / skinny / 1e9
        figures.append(RowFigures(isa, shape, dtype_name, r, skinny * 1e6, linear * 1e6, gbps, gbps / ceiling,
                                  skinny / first))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 5, 6, 8, 16])
    parser.add_argument("--set-mib", type=int, default=64, help="the rotating weights' total (>= 2x L3)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the process's CPU time, not the wall clock: on a machine others share, the time "
                             "this process waits off the CPU is left out (exact with one thread: OMP_NUM_THREADS=1)")
    parser.add_argument("--json", action="store_true", help="one JSON object a line instead of the table")
    args = parser.parse_args()
    build = load_cpu_kernels()
    if not build.available:
        raise SystemExit(f"minivllm's CPU kernels are not built here: {build.detail}")
    clock = time.process_time if args.cpu_time else time.perf_counter
    ceiling = read_bandwidth(clock=clock)
    isa = f"{isa_level()}/{torch.backends.cpu.get_cpu_capability()}"
    print(f"{isa}  threads {torch.get_num_threads()}  read bandwidth {ceiling:.1f} GB/s  "
          f"weights rotate through {args.set_mib} MiB  clock {'cpu' if args.cpu_time else 'wall'}")
    if not args.json:
        print(f"{'isa':<18}{'shape':<9}{'dtype':<10}{'rows':>4}{'skinny us':>11}{'F.linear us':>13}"
              f"{'GB/s':>7}{'ceiling':>9}{'/rows1':>8}{'linear/skinny':>15}")
    for shape in args.shapes:
        for dtype in args.dtypes:
            for f in measure(shape, dtype, args.rows, ceiling, args.set_mib << 20, args.rounds, clock=clock):
                if args.json:
                    print(json.dumps(asdict(f)))
                else:
                    print(f"{f.isa:<18}{f.shape:<9}{f.dtype:<10}{f.rows:>4}{f.skinny_us:>11.1f}{f.linear_us:>13.1f}"
                          f"{f.skinny_gbps:>7.1f}{f.of_ceiling:>8.0%}{f.of_rows1:>8.2f}"
                          f"{f.linear_us / f.skinny_us:>15.2f}", flush=True)


if __name__ == "__main__":
    main()
