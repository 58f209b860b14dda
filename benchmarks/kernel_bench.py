"""Decode-kernel micro-benchmark (needs CUDA): achieved memory bandwidth of the Triton decode kernels
against the GPU's own copy bandwidth and against PyTorch SDPA on contiguous (unpaged) K/V.

Kernels: `grouped` (kernels/grouped_decode_attention.py, what the Triton backend runs for decode steps,
its split count from `choose_num_splits`), and the two it replaced, `paged` (paged_attention.py, one
program per query head) and `split` (split_kv_decode.py, per-query-head flash-decoding).

A decode step reads every cached key and value once, so bytes = 2 * batch * context * Hkv * D * itemsize;
GB/s = bytes / kernel time. The reference peak is a large device-to-device copy (read + write).

    python benchmarks/kernel_bench.py [--batch 1 8 32] [--contexts 1024 4096] [--heads 32 8] [--head-dim 128]

`benchmarks/cuda_check.py` imports `measure` for its batch 1 and batch 32 x 4,096 rows.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass(frozen=True)
class DecodeFigures:
    """GB/s of each kernel on one shape, and its share of the copy bandwidth measured in the same run."""

    shape: DecodeShape
    copy_gbps: float
    grouped_gbps: float
    grouped_splits: int
    paged_gbps: float
    split_gbps: float
    sdpa_gbps: float

    @property
    def grouped_of_copy(self) -> float:
        return self.grouped_gbps / self.copy_gbps

    @property
    def sdpa_time_ratio(self) -> float:
        """grouped kernel time / SDPA time (the target is <= 1.3)."""
        return self.sdpa_gbps / self.grouped_gbps

    def as_json(self) -> dict:
        return {**asdict(self), "grouped_of_copy": self.grouped_of_copy, "sdpa_time_ratio": self.sdpa_time_ratio}


def copy_bandwidth(dev: torch.device, nbytes: int = 1 << 30) -> float:
    """GB/s of a large device-to-device copy (read + write): the practical memory peak."""
    import triton.testing

    big = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return 2 * nbytes / triton.testing.do_bench(lambda: big.clone()) / 1e6


def measure(shape: DecodeShape, peak: float, dev: torch.device) -> DecodeFigures:
    """Every kernel on one shape, fp16, on scattered physical blocks."""
    import triton.testing

    from minivllm.kernels.grouped_decode_attention import choose_num_splits, grouped_decode_attention
    from minivllm.kernels.paged_attention import paged_attention, plan_tiles
    from minivllm.kernels.split_kv_decode import split_kv_decode

    dtype, (batch, ctx) = torch.float16, (shape.batch, shape.context)
    Hq, Hkv, D, B = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
    nblocks = -(-ctx // B)
    k_cache = torch.randn(batch * nblocks, B, Hkv, D, dtype=dtype, device=dev)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * nblocks, device=dev, dtype=torch.int32).view(batch, nblocks)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, Hq, D, dtype=dtype, device=dev)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    ts, st = plan_tiles([1] * batch, 16)
    tiles = (torch.tensor(ts, dtype=torch.int32, device=dev), torch.tensor(st, dtype=torch.int32, device=dev))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grouped_splits = choose_num_splits(batch, Hkv, ctx, sms)
    old_splits = max(2, min(16, -(-2 * sms // (batch * Hq)), nblocks // 2))  # the rule split-KV ran with
    scale = D ** -0.5
    times = {
        "grouped": lambda: grouped_decode_attention(q, k_cache, v_cache, tables, lens, scale, grouped_splits),
        "paged": lambda: paged_attention(q, k_cache, v_cache, tables, cu, lens, scale, tiles, 16),
        "split": lambda: split_kv_decode(q, k_cache, v_cache, tables, lens, scale, old_splits),
    }
    kd = torch.randn(batch, Hkv, ctx, D, dtype=dtype, device=dev)
    vd = torch.randn_like(kd)
    qd = q.view(batch, Hkv, Hq // Hkv, D)  # SDPA sees the G heads of a KV head as G query rows: no repeat
    times["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd)
    gb = 2 * batch * ctx * Hkv * D * 2 / 1e9
    gbps = {name: gb / (triton.testing.do_bench(fn) / 1e3) for name, fn in times.items()}
    return DecodeFigures(shape, peak, gbps["grouped"], grouped_splits, gbps["paged"], gbps["split"], gbps["sdpa"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU (the Triton interpreter on CPU says nothing about speed); skipping.")
        return 0
    dev = torch.device("cuda")
    peak = copy_bandwidth(dev)
    Hq, Hkv = args.heads
    print(f"{torch.cuda.get_device_name(dev)}: device copy {peak:.0f} GB/s; Hq={Hq} Hkv={Hkv} D={args.head_dim} "
          f"fp16 block={args.block_size}")
    print(f"{'batch':>5} {'ctx':>5} | {'grouped GB/s':>12} {'%copy':>6} {'splits':>6} | {'paged':>6} {'split':>6} | "
          f"{'SDPA GB/s':>9} {'%copy':>6} | {'grouped/SDPA time':>17}")
    for batch in args.batch:
        for ctx in args.contexts:
            f = measure(DecodeShape(batch, ctx, Hq, Hkv, args.head_dim, args.block_size), peak, dev)
            print(f"{batch:>5} {ctx:>5} | {f.grouped_gbps:>12.0f} {100 * f.grouped_of_copy:>5.0f}% "
                  f"{f.grouped_splits:>6} | {f.paged_gbps:>6.0f} {f.split_gbps:>6.0f} | {f.sdpa_gbps:>9.0f} "
                  f"{100 * f.sdpa_gbps / peak:>5.0f}% | {f.sdpa_time_ratio:>17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
