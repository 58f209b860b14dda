"""cpu_fused_moe (the experts through the packed skinny-GEMM kernels) against naive_fused_moe.

Decode sizes (1-16 tokens: every active expert through skinny_gemm), prefill sizes (an expert with more than
SKINNY_MAX_ROWS rows: F.linear on its laid-back weight) and both in one step; experts no route chose; odd
sizes that pad the 16-column blocks. The AVX2 path (x86-64-v3) runs this file again in a process of its own
(MINIVLLM_CPU_ISA=avx2: the kernels built for that level, the AVX-512 flags hidden)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_helpers import require_cpu_kernels
from minivllm.kernels.cpu_build import isa_level
from minivllm.kernels.fused_moe import naive_fused_moe
from minivllm.kernels.moe_cpu import (SKINNY_MAX_ROWS, can_pack_moe, cpu_fused_moe, pack_moe_experts, sort_routes,
                                      unpack_expert)
from minivllm.kernels.skinny_gemm import pack_skinny_weight

require_cpu_kernels()

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make_experts(E: int, H: int, I: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)  # (E, 2I, H)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)  # (E, H, I)
    return w13, w2


def route(T: int, E: int, k: int, seed: int, experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routes of T tokens, renormalized as Qwen3-MoE does; only the first `experts` may be chosen."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)  # (T, E)
    if experts is not None:
        logits[:, experts:] = -float("inf")
    topk_weights, topk_ids = logits.softmax(-1).topk(k, dim=-1)  # (T, k) each
    return topk_weights / topk_weights.sum(-1, keepdim=True), topk_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("E,H,I,k", [(8, 64, 32, 2), (16, 96, 40, 4), (6, 50, 18, 3)])  # 50 x 18: padded blocks
def test_matches_naive(dtype, T, E, H, I, k):
    """A few tokens over many experts (most unused); 17 and 40 tokens over 6-8 experts put more than 16 rows on
    some experts (the F.linear path) beside experts of a few rows (skinny_gemm) in one step."""
    w13, w2 = make_experts(E, H, I, dtype, seed=E + T)
    topk_weights, topk_ids = route(T, E, k, seed=T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
    out = cpu_fused_moe(x, pack_moe_experts(w13, w2), topk_weights, topk_ids)
    assert out.shape == (T, H) and out.dtype == dtype
    torch.testing.assert_close(out, naive_fused_moe(x, w13, w2, topk_weights, topk_ids), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_no_route_chose_are_never_read(dtype):
    """NaN in every expert the routes skip: a kernel that touched one would return NaN (0 x NaN is NaN)."""
    E, H, I, k, T = 12, 64, 48, 2, 4
    w13, w2 = make_experts(E, H, I, dtype, seed=1)
    topk_weights, topk_ids = route(T, E, k, seed=2, experts=5)  # experts 5 .. 11 unused
    w13[5:], w2[5:] = float("nan"), float("nan")
    x = torch.randn(T, H).to(dtype)
    out = cpu_fused_moe(x, pack_moe_experts(w13, w2), topk_weights, topk_ids)
    assert not out.isnan().any()
    torch.testing.assert_close(out, naive_fused_moe(x, w13, w2, topk_weights, topk_ids), **TOL[dtype])


def test_a_step_of_no_tokens_reads_nothing():
    w13, w2 = make_experts(4, 32, 16, torch.bfloat16, seed=9)
    out = cpu_fused_moe(torch.empty(0, 32).bfloat16(), pack_moe_experts(w13, w2), torch.empty(0, 2),
                        torch.empty(0, 2, dtype=torch.long))
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


def test_a_misrouted_token_is_caught():
    """The comparison fails a kernel that reads another expert for one route: the test can fail."""
    w13, w2 = make_experts(8, 64, 32, torch.float32, seed=3)
    topk_weights, topk_ids = route(3, 8, 2, seed=4)
    x = torch.randn(3, 64)
    wrong = topk_ids.clone()
    wrong[1, 0] = (wrong[1, 0] + 1) % 8 if (wrong[1, 0] + 1) % 8 != wrong[1, 1] else (wrong[1, 0] + 2) % 8
    out = cpu_fused_moe(x, pack_moe_experts(w13, w2), topk_weights, wrong)
    assert not torch.allclose(out, naive_fused_moe(x, w13, w2, topk_weights, topk_ids), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_is_each_expert_packed_alone_and_unpacks_to_it(dtype):
    """One pack over all experts equals skinny_gemm's own pack of each (padding per expert), and unpack inverts it."""
    w13, w2 = make_experts(3, 50, 18, dtype, seed=5)  # 2I = 36, H = 50: neither a multiple of 16
    packed = pack_moe_experts(w13, w2)
    assert (packed.hidden_size, packed.intermediate_size, packed.num_experts) == (50, 18, 3)
    for e in range(3):
        assert torch.equal(packed.w13[e], pack_skinny_weight(w13[e])) and torch.equal(packed.w2[e],
                                                                                      pack_skinny_weight(w2[e]))
        assert torch.equal(unpack_expert(packed.w13[e], 36), w13[e]) and torch.equal(unpack_expert(packed.w2[e], 50),
                                                                                     w2[e])


def test_routes_are_sorted_by_expert_with_their_tokens_and_weights():
    topk_ids = torch.tensor([[3, 0], [0, 7], [3, 1]])  # (T=3, k=2)
    topk_weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5]])
    routes = sort_routes(topk_weights, topk_ids, num_experts=8)
    assert routes.experts == [(0, 0, 2), (1, 2, 3), (3, 3, 5), (7, 5, 6)]  # inactive experts 2, 4, 5, 6 absent
    counted = sort_routes(topk_weights, topk_ids, 8, counts=torch.tensor([2, 1, 0, 2, 0, 0, 0, 1]))
    assert counted.experts == routes.experts  # the layer's own count (FusedMoE.last_load) gives the same groups
    assert routes.token_ids.tolist() == [0, 1, 2, 0, 2, 1]
    assert routes.weights.tolist() == pytest.approx([0.4, 0.9, 0.5, 0.6, 0.5, 0.1])


def test_bad_inputs_are_refused_with_what_to_change():
    w13, w2 = make_experts(4, 32, 16, torch.float32, seed=6)
    packed = pack_moe_experts(w13, w2)
    with pytest.raises(ValueError, match=r"w13 \(E, 2I, H\) and w2 \(E, H, I\)"):
        pack_moe_experts(w13, w2[:, :, :8])
    with pytest.raises(ValueError, match="even hidden and intermediate size"):
        pack_moe_experts(*make_experts(2, 32, 15, torch.bfloat16, seed=0))
    assert not can_pack_moe(w13.half(), w2.half())
    topk_weights, topk_ids = route(2, 4, 2, seed=7)
    with pytest.raises(ValueError, match=r"the experts take \(T, 32\) torch.float32"):
        cpu_fused_moe(torch.randn(2, 32).bfloat16(), packed, topk_weights, topk_ids)
    with pytest.raises(ValueError, match=r"must both be \(T, k\) with T = 3"):
        cpu_fused_moe(torch.randn(3, 32), packed, topk_weights, topk_ids)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        cpu_fused_moe(torch.randn(2, 32), packed, topk_weights, topk_ids + 3)


def test_decode_sizes_read_the_packed_weights_and_larger_ones_lay_them_back_out(monkeypatch):
    """16 tokens on one expert: skinny_gemm on the packed weight; 17: F.linear on the weight laid back out."""
    from minivllm.kernels import moe_cpu

    unpacked = []
    monkeypatch.setattr(moe_cpu, "unpack_expert", lambda p, n: unpacked.append(n) or unpack_expert(p, n))
    w13, w2 = make_experts(2, 32, 16, torch.float32, seed=8)
    packed = pack_moe_experts(w13, w2)
    for T, expected in ((SKINNY_MAX_ROWS, []), (SKINNY_MAX_ROWS + 1, [32, 32])):
        topk_ids, topk_weights = torch.ones(T, 1, dtype=torch.long), torch.ones(T, 1)  # every token to expert 1
        x = torch.randn(T, 32)
        torch.testing.assert_close(cpu_fused_moe(x, packed, topk_weights, topk_ids),
                                   naive_fused_moe(x, w13, w2, topk_weights, topk_ids), **TOL[torch.float32])
        assert unpacked == expected, T


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(platform.machine() != "x86_64" or isa_level() != "native", reason="x86-64, from the native run")
def test_the_avx2_build_passes_these_tests():
    """MINIVLLM_CPU_ISA=avx2 builds the kernels for -march=x86-64-v3 (skinny_gemm's AVX2 path, bf16 widened in
    registers; silu·mul on 8 lanes) under a name of its own, and this file runs against it."""
    env = {**os.environ, "MINIVLLM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    flags = Path("/proc/cpuinfo").read_text()
    if not all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c", "bmi2", "movbe")):
        pytest.skip("this CPU cannot run the x86-64-v3 build")
    probe = ("from minivllm.kernels.cpu_build import load_cpu_kernels; b = load_cpu_kernels(); "
             "assert b.available, b.detail; print(b.detail)")
    built = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0 and "built for ISA level avx2 (-march=x86-64-v3)" in built.stdout, \
        built.stderr[-2000:]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
                            __file__], env=env, capture_output=True, text=True, timeout=600,
                           cwd=Path(__file__).parent.parent.parent)
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]
