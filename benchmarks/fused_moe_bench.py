"""Fused-MoE micro-benchmark (needs CUDA): the Triton kernel (kernels/fused_moe.py) against the naive
per-expert loop on one bf16 MoE layer of Qwen3-30B-A3B's shape (128 experts, top 8, hidden 2,048,
expert intermediate 768), at decode and prefill sizes, and checked against it.

What each figure compares with, measured in the same run:
  x_naive          naive_fused_moe's time / the kernel's (the loop gathers each expert's tokens: a sync and
                   six launches an expert, its weights cast to fp32)
  weights_of_copy  decode is a read of the active experts' weights, active * 3 * I * H * 2 bytes; that many
                   bytes / the kernel's time, as a share of the GPU's copy bandwidth (kernel_bench.py's)
  x_dense          a dense bf16 matmul pair with the same flops (T*k rows through one expert's w13 and w2:
                   a perfectly balanced grouped matmul, cuBLAS) / the kernel's time: 1.0 would be no cost
                   for the grouping at all
The kernel's time covers all of `fused_moe` (the alignment's small torch ops, both launches, the
activation and the sum), as a model would call it, outside a CUDA graph.

    python benchmarks/fused_moe_bench.py [--tokens 1 32 2048]

`benchmarks/cuda_check.py`'s `fused_moe` part is `check_on_gpu`: these three sizes, each kernel result within
3 % of naive_fused_moe's largest output value (bf16 intermediates, unit roundoff 2^-8, against fp32 ones: a
few units at the output's scale, where one misrouted route moves outputs by their own size).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch
import triton.testing

from minivllm.kernels.fused_moe import fused_moe, naive_fused_moe  # imported by a dry run too: fails there if it cannot

QWEN3_30B_A3B = {"num_experts": 128, "top_k": 8, "hidden_size": 2048, "moe_intermediate_size": 768}


@dataclass(frozen=True)
class MoeFigures:
    tokens: int
    active_experts: int
    kernel_ms: float
    naive_ms: float
    dense_ms: float
    weights_of_copy: float
    max_abs_error: float  # kernel against naive_fused_moe (fp32 throughout), bf16 result
    max_abs_output: float

    @property
    def close_to_naive(self) -> bool:
        return self.max_abs_error <= 0.03 * self.max_abs_output

    def as_json(self) -> dict:
        return {**asdict(self), "x_naive": self.naive_ms / self.kernel_ms, "x_dense": self.dense_ms / self.kernel_ms}


def measure_moe(tokens: int, copy_gbps: float, dev: torch.device, seed: int = 0) -> MoeFigures:
    """One layer, `tokens` rows, HF-style routing of random logits (softmax, top-k, renormalised)."""
    E, k, H, I = QWEN3_30B_A3B.values()
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) / H ** 0.5).to(torch.bfloat16)  # (E, 2I, H)
    w2 = (torch.randn(E, H, I, generator=g, device=dev) / I ** 0.5).to(torch.bfloat16)  # (E, H, I)
    x = torch.randn(tokens, H, generator=g, device=dev).to(torch.bfloat16)  # (T, H)
    weights, ids = torch.randn(tokens, E, generator=g, device=dev).softmax(-1).topk(k)  # (T, k) each
    weights = weights / weights.sum(-1, keepdim=True)
    out = fused_moe(x, w13, w2, weights, ids).float()
    ref = naive_fused_moe(x, w13, w2, weights, ids).float()
    # dense peer: the same rows and flops through one expert's weights, two cuBLAS matmuls
    rows = torch.randn(tokens * k, H, generator=g, device=dev).to(torch.bfloat16)  # (T*k, H)
    act = torch.randn(tokens * k, I, generator=g, device=dev).to(torch.bfloat16)  # (T*k, I)
    kernel_ms = triton.testing.do_bench(lambda: fused_moe(x, w13, w2, weights, ids))
    naive_ms = triton.testing.do_bench(lambda: naive_fused_moe(x, w13, w2, weights, ids), rep=200)
    dense_ms = triton.testing.do_bench(lambda: (rows @ w13[0].T, act @ w2[0].T))
    active = int(ids.unique().numel())
    weight_gb = active * 3 * I * H * 2 / 1e9
    return MoeFigures(tokens, active, kernel_ms, naive_ms, dense_ms, weight_gb / (kernel_ms / 1e3) / copy_gbps,
                      (out - ref).abs().max().item(), ref.abs().max().item())


def check_on_gpu(dry_run: bool, tokens: tuple[int, ...] = (1, 32, 2048)) -> dict:
    """cuda_check.py's part: the figures of each size, failing when the kernel is off naive_fused_moe; a dry
    run stops after this module's imports (the kernel's module among them; it compiles nothing until called)."""
    from kernel_bench import copy_bandwidth

    if dry_run:
        return {"dry_run": True}
    dev = torch.device("cuda")
    peak = copy_bandwidth(dev)
    rows = {f"T={t}": measure_moe(t, peak, dev) for t in tokens}
    assert all(r.close_to_naive for r in rows.values()), f"the kernel is off naive_fused_moe: {rows}"
    return {"copy_gbps": peak, "rows": {name: r.as_json() for name, r in rows.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 2048])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark runs the kernel compiled for a GPU (tests: the interpreter)")
    print(json.dumps(check_on_gpu(dry_run=False, tokens=tuple(args.tokens)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
