"""skinny_gemm (the compiled CPU kernel) against its naive reference.

CI builds the kernel (it has a compiler and ninja), so there a failed build is a failure; elsewhere a
machine without a compiler skips these tests with the reason, as the matmul plan skips the form. The
code paths for other instruction sets are checked in test_isa_levels.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import require_cpu_kernels
from minivllm.kernels.skinny_gemm import (LANES, can_pack_skinny, naive_skinny_gemm, pack_skinny_weight, skinny_gemm,
                                          skinny_gemm_tiling)
from torch.utils._python_dispatch import TorchDispatchMode


require_cpu_kernels()


def test_the_packed_layout_is_blocks_of_16_output_columns():
    w = torch.arange(20 * 6, dtype=torch.float32).view(20, 6)  # 20 outputs: one full block, one padded
    p = pack_skinny_weight(w)
    assert p.shape == (2, 6, LANES)
    assert torch.equal(p[0, 3], w[:16, 3]) and torch.equal(p[1, 5, :4], w[16:, 5])
    assert p[1, :, 4:].abs().sum() == 0  # padding columns are zero
    pb = pack_skinny_weight(w.bfloat16())
    assert pb.shape == (2, 3, LANES, 2)  # k in pairs
    assert torch.equal(pb[0, 1, 7], w.bfloat16()[7, 2:4])


def naive_pack(weight: torch.Tensor) -> torch.Tensor:
    """The packed layout the plain way: pad to whole blocks, then move every element on its own."""
    n_blocks = math.ceil(weight.shape[0] / LANES)
    w = F.pad(weight, (0, 0, 0, n_blocks * LANES - weight.shape[0]))  # (n_blocks * 16, in)
    if weight.dtype == torch.float32:
        return w.view(n_blocks, LANES, -1).transpose(1, 2).contiguous()  # (n_blocks, in, 16)
    return w.view(n_blocks, LANES, -1, 2).permute(0, 2, 1, 3).contiguous()  # (n_blocks, in/2, 16, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_f,in_f", [(48, 64), (960, 576), (37, 10), (20, 6)])  # whole blocks, then padded
def test_packing_gives_the_plain_layout_byte_for_byte(dtype, out_f, in_f):
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(out_f)).to(dtype)
    p, ref = pack_skinny_weight(w), naive_pack(w)
    assert p.shape == ref.shape and p.dtype == dtype and p.is_contiguous()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(p.view(bits), ref.view(bits))
    odd = torch.cat([torch.zeros(1, dtype=dtype), w.flatten()])[1:].view(out_f, in_f)  # a view at an odd offset
    assert torch.equal(pack_skinny_weight(odd).view(bits), ref.view(bits))


class _Copies(TorchDispatchMode):
    """Records the ops that write new memory (the output is not a view of the first input): (name, input dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if isinstance(out, torch.Tensor) and src is not None and (
                out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()):
            self.copies.append((func.overloadpacket.__name__, src.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_copies_the_weight_once(dtype):
    """Every start packs every weight: one copy, no padding copy where out_features is whole blocks (every
    SmolLM2 weight), and a bf16 weight moved as int32 k pairs (a 4-byte element per move, ~3x faster)."""
    moved_as = torch.int32 if dtype == torch.bfloat16 else torch.float32
    for out_f, copies in ((64, [("clone", moved_as)]), (20, [("constant_pad_nd", dtype), ("clone", moved_as)])):
        w = torch.randn(out_f, 32).to(dtype)
        with _Copies() as seen:
            pack_skinny_weight(w)
        assert seen.copies == copies, out_f


def error_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact x w^T + b (float64) and how far an fp32 sum of it, in any order, rounded once to x's dtype, may
    land from it: g(K + 1) sum_k |x_k w_k| + |b| (K products and sums, and the bias; g(n) = n u / (1 - n u),
    u = 2^-24) plus half an ulp of the output's dtype (2^-8 relative for bf16)."""
    u, n = 2.0 ** -24, x.shape[1] + 1
    exact = x.double() @ w.double().t()  # (rows, out)
    spread = x.double().abs() @ w.double().abs().t()
    if bias is not None:
        exact, spread = exact + bias.double(), spread + bias.double().abs()
    bound = n * u / (1 - n * u) * spread  # the fp32 sum's error
    if x.dtype == torch.bfloat16:  # then rounded to bf16: half an ulp of the sum, |sum| <= |exact| + its error
        bound = bound + 2.0 ** -8 * (exact.abs() + bound)
    return exact, bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17])
@pytest.mark.parametrize("out_f,in_f", [(16, 32), (37, 10), (160, 96), (200, 578)])
def test_matches_naive(dtype, rows, out_f, in_f):
    """1-8 rows share one read of the weight (tiles of 1-4 columns); 9, 13, 17 rows end in a pass of 1, 5, 1."""
    g = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    w = (torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    packed = pack_skinny_weight(w)
    for b in (None, bias):
        y = skinny_gemm(x, packed, out_f, b)
        assert y.shape == (rows, out_f) and y.dtype == dtype
        exact, bound = error_bound(x, w, b)
        assert ((y.double() - exact).abs() <= bound).all()
        assert ((naive_skinny_gemm(x, w, b).double() - exact).abs() <= bound).all()  # the bound holds the reference


def test_the_error_bound_catches_a_misread_weight():
    """The bound is tight enough to fail a kernel that reads one weight of a row wrong (here: zeroed)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 64, generator=g), torch.randn(48, 64, generator=g) / 8
    exact, bound = error_bound(x, w, None)
    broken = w.clone()
    broken[17, 40] = 0.0
    assert not ((skinny_gemm(x, pack_skinny_weight(broken), 48).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_never_depends_on_the_rows_beside_it(dtype):
    """Rows share passes of up to 8 and tiles of 1-8; each output sums its own row in one fixed order, so any
    count of rows, odd or even, gives a row the bits it has alone (200 outputs: 3 groups of 4 blocks and a
    tail block)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(17, 96, generator=g).to(dtype), torch.randn(200, 96, generator=g).to(dtype)
    packed = pack_skinny_weight(w)
    alone = torch.cat([skinny_gemm(x[i:i + 1], packed, 200) for i in range(17)])
    for rows in range(2, 18):
        assert torch.equal(skinny_gemm(x[:rows], packed, 200), alone[:rows]), rows
    assert torch.equal(skinny_gemm(x[9:16], packed, 200), alone[9:16])  # 7 rows from the middle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_up_to_eight_rows_share_one_read_of_the_weight_within_the_register_file(dtype):
    """A verify step of 1 + k rows (k drafts) reads the weight once, as a decode step does, up to 8 rows; each
    tile's accumulators, weight vectors and broadcast x fit the registers of the build's ISA (no spills by design)."""
    for rows in range(1, 18):
        t = skinny_gemm_tiling(rows, dtype)
        assert t.rows_per_pass == 8 and t.passes == -(-rows // 8), (rows, t)
        assert t.lanes in (8, 16) and (4 * LANES) % (t.columns * t.lanes) == 0, (rows, t)  # tiles cut a group
        assert t.registers_used <= t.registers, (rows, t)
        assert t.registers_used >= t.columns * min(rows, 8) + 1  # the accumulators and one x at least


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
