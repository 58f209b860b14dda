"""Decode-kernel micro-benchmark (needs CUDA): achieved memory bandwidth of the Triton paged-attention
and split-KV decode kernels against the GPU's own copy bandwidth and against PyTorch SDPA on
contiguous (unpaged) K/V, over contexts 128-4096.

A decode step reads every cached key and value once, so bytes = 2 * batch * context * Hkv * D * itemsize;
GB/s = bytes / kernel time. The reference peak is a large device-to-device copy (read + write).

    python benchmarks/kernel_bench.py [--batch 1 8 32] [--heads 32 8] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import sys

import torch


def copy_bandwidth(dev: torch.device, nbytes: int = 1 << 30) -> float:
    """GB/s of a large device-to-device copy (read + write): the practical memory peak."""
    import triton.testing

    big = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return 2 * nbytes / triton.testing.do_bench(lambda: big.clone()) / 1e6


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

    import triton.testing
    from minivllm.kernels.paged_attention import paged_attention, plan_tiles
    from minivllm.kernels.split_kv_decode import split_kv_decode

    dev, dtype = torch.device("cuda"), torch.float16
    Hq, Hkv = args.heads
    D, B = args.head_dim, args.block_size
    peak = copy_bandwidth(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}: device copy {peak:.0f} GB/s; Hq={Hq} Hkv={Hkv} D={D} fp16 block={B}")
    print(f"{'batch':>5} {'ctx':>5} | {'paged GB/s':>10} {'%peak':>6} | {'split GB/s':>10} {'%peak':>6} "
          f"{'splits':>6} | {'SDPA GB/s':>9} {'%peak':>6}")
    for batch in args.batch:
        for ctx in args.contexts:
            nblocks = -(-ctx // B)
            k_cache = torch.randn(batch * nblocks, B, Hkv, D, dtype=dtype, device=dev)
            v_cache = torch.randn_like(k_cache)
            tables = torch.randperm(batch * nblocks, device=dev, dtype=torch.int32).view(batch, nblocks)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(batch, Hq, D, dtype=dtype, device=dev)
            cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
            ts, st = plan_tiles([1] * batch, 16)
            tiles = (torch.tensor(ts, dtype=torch.int32, device=dev), torch.tensor(st, dtype=torch.int32, device=dev))
            splits = max(2, min(16, -(-2 * sms // (batch * Hq)), nblocks // 2))
            scale = D ** -0.5
            t_paged = triton.testing.do_bench(lambda: paged_attention(q, k_cache, v_cache, tables, cu, lens, scale,
                                                                      tiles, 16))
            t_split = triton.testing.do_bench(lambda: split_kv_decode(q, k_cache, v_cache, tables, lens, scale, splits))
            kd = torch.randn(batch, Hkv, ctx, D, dtype=dtype, device=dev)
            vd = torch.randn_like(kd)
            qd = q.view(batch, Hkv, Hq // Hkv, D)
            t_sdpa = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd))
            gb = 2 * batch * ctx * Hkv * D * 2 / 1e9
            row = [gb / (t / 1e3) for t in (t_paged, t_split, t_sdpa)]
            print(f"{batch:>5} {ctx:>5} | {row[0]:>10.0f} {100 * row[0] / peak:>5.0f}% | {row[1]:>10.0f} "
                  f"{100 * row[1] / peak:>5.0f}% {splits:>6} | {row[2]:>9.0f} {100 * row[2] / peak:>5.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
