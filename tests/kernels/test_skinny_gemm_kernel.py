"""skinny_gemm (the compiled CPU kernel) against its naive reference.

CI builds the kernel (it has a compiler and ninja), so there a failed build is a failure; elsewhere a
machine without a compiler skips these tests with the reason, as the matmul plan skips the form."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch
from minivllm.kernels.skinny_gemm import (LANES, _cause, build_skinny_gemm, can_pack_skinny, load_skinny_gemm,
                                          naive_skinny_gemm, pack_skinny_weight, skinny_gemm)


@pytest.fixture(scope="module", autouse=True)
def built():
    build = load_skinny_gemm()
    if not build.available:
        assert not os.environ.get("CI"), f"CI must build the skinny kernel: {build.detail}"
        pytest.skip(build.detail)


def test_the_packed_layout_is_blocks_of_16_output_columns():
    w = torch.arange(20 * 6, dtype=torch.float32).view(20, 6)  # 20 outputs: one full block, one padded
    p = pack_skinny_weight(w)
    assert p.shape == (2, 6, LANES)
    assert torch.equal(p[0, 3], w[:16, 3]) and torch.equal(p[1, 5, :4], w[16:, 5])
    assert p[1, :, 4:].abs().sum() == 0  # padding columns are zero
    pb = pack_skinny_weight(w.bfloat16())
    assert pb.shape == (2, 3, LANES, 2)  # k in pairs
    assert torch.equal(pb[0, 1, 7], w.bfloat16()[7, 2:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("out_f,in_f", [(16, 32), (37, 10), (160, 96), (200, 578)])
def test_matches_naive(dtype, rows, out_f, in_f):
    g = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    w = (torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    packed = pack_skinny_weight(w)
    for b in (None, bias):
        y = skinny_gemm(x, packed, out_f, b)
        assert y.shape == (rows, out_f) and y.dtype == dtype
        # fp32 sums in another order; bf16 output rounds once more than the fp32 reference
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(y.float(), naive_skinny_gemm(x, w, b).float(), **tol)


def test_a_row_never_depends_on_the_rows_beside_it():
    """Rows are grouped by four inside the kernel; each output sums its own row in a fixed order."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 64, generator=g), torch.randn(48, 64, generator=g)
    packed = pack_skinny_weight(w)
    alone = torch.cat([skinny_gemm(x[i:i + 1], packed, 48) for i in range(7)])
    assert torch.equal(skinny_gemm(x, packed, 48), alone)


def test_bad_inputs_are_refused_with_what_to_change():
    w = torch.randn(32, 16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        skinny_gemm(torch.randn(1, 16).bfloat16(), pack_skinny_weight(w), 32)
    with pytest.raises(RuntimeError, match="features"):
        skinny_gemm(torch.randn(1, 8), pack_skinny_weight(w), 32)
    with pytest.raises(RuntimeError, match="pack_skinny_weight"):  # packed from another out_features
        skinny_gemm(torch.randn(1, 16), pack_skinny_weight(torch.randn(40, 16)), 20)
    with pytest.raises(RuntimeError, match="pack_skinny_weight"):  # the fp32 layout for a bf16 product
        skinny_gemm(torch.randn(1, 16).bfloat16(), pack_skinny_weight(w).bfloat16(), 32)
    with pytest.raises(RuntimeError, match="bias"):
        skinny_gemm(torch.randn(1, 16), pack_skinny_weight(w), 32, torch.randn(2, 16))
    with pytest.raises(ValueError, match="even in_features"):
        pack_skinny_weight(torch.randn(4, 5).bfloat16())
    assert not can_pack_skinny(torch.randn(4, 5).bfloat16()) and not can_pack_skinny(torch.randn(4, 4).half())


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(),
                    reason="x86-64 instruction sets")
@pytest.mark.parametrize("variant,cflags", [("avx2", ["-march=x86-64-v3"]),
                                            ("avx512_no_bf16", ["-march=x86-64-v4", "-mno-avx512bf16"])])
def test_the_other_instruction_set_paths_match_naive_too(variant, cflags):
    """This machine runs one path of the kernel (the one -march=native selects); CPUs without AVX-512,
    or without its BF16 dot products, run the others. Built here under another op name and checked."""
    needs = {"avx2": {"avx2", "fma"}, "avx512_no_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}[variant]
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {variant} build")
    library = f"skinny_test_{variant}"
    build_skinny_gemm(f"minivllm_{library}", cflags, library=library)
    op = getattr(torch.ops, library).skinny_gemm
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, out_f, in_f in [(1, 37, 10), (5, 200, 578), (9, 64, 96)]:
            x = torch.randn(rows, in_f, generator=g).to(dtype)
            w = (torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(dtype)
            bias = torch.randn(out_f, generator=g).to(dtype)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(op(x, pack_skinny_weight(w), out_f, bias).float(),
                                       naive_skinny_gemm(x, w, bias).float(), **tol)


def test_a_failed_build_reports_the_compiler_error_not_the_command_line():
    text = ("Error building extension 'x': [1/2] c++ -MMD -MF sg.o.d -isystem /very/long/include/path ...\n"
            "FAILED: sg.o\nc++: error: unrecognized command-line option '-mfoo'\nninja: build stopped")
    assert _cause(text) == "c++: error: unrecognized command-line option '-mfoo'"
    assert _cause("something else went wrong\nlast line") == "last line"
