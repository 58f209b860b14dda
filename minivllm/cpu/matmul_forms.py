"""The five ways a CPU linear layer can compute y = x W^T, and the code of each; `MatmulPlan`
(matmul_plan.py) chooses among them by timing, and `default_form` says which one runs untimed.

A decode step multiplies a few rows x (rows, in) by each weight W (out, in). Five forms give the same y:

    LINEAR       y = F.linear(x, W) = x W^T    torch's default; MKL / oneDNN picks the kernel
    WEIGHT_LEFT  y = (W x^T)^T                 W stays the left, row-major operand; a single row is
                                               stacked twice so the product stays a gemm, not a gemv
    PACKED       y = x W^T, W reordered once   oneDNN's blocked weight layout, made at warm-up
                 into oneDNN's blocked layout  (`pack`), as vLLM's CPU backend and Inductor's
                                               freezing pass prepack theirs
    SKINNY       y = x W^T, W re-laid out      minivllm's own CPU kernel for a few rows
                 in blocks of 16 columns       (kernels/skinny_gemm.py): one sequential read of the
                                               weight, no horizontal sums; compiled on first use
    WIDENED      y = round(x32 W32^T)          bf16 operands widened to fp32 (in blocks of weight rows),
                                               one fp32 GEMM (MKL), the output rounded back to bf16

Why WIDENED exists: torch's bf16 GEMM is fast only where oneDNN takes bf16 (`CpuInfo.onednn_bf16`:
AVX-512 BW+VL+DQ or AVX-NE-CONVERT). On an AVX2-only CPU (Zen 3, most laptops) bf16 F.linear falls to
a slow path: 576 -> 1536 at 32 and 128 rows took 3-4.5x the time of widening both operands and running
MKL's fp32 GEMM (1 thread, capped AVX2 level on a Zen 4). Widening costs a pass over the weight, so at
1-3 rows (bound by reading the weight) plain bf16 F.linear stays 1.2-3x faster, about even at 4:
`default_form` is WIDENED for bf16 without oneDNN's bf16 from `WIDENED_FROM_ROWS` rows, LINEAR
everywhere else. The weight is widened `WIDEN_BLOCK_BYTES` at a time: a whole fp32 copy of the
49152 x 576 LM head is 113 MB, a fresh mmap whose pages fault in on every call (74 ms at one row,
against 7 ms in blocks of 2 MiB, which the allocator reuses; the same speed on smaller weights).

PACKED and SKINNY read a copy of W in their own layout, kept on the weight as `weight.packed` /
`weight.skinny` (made by the plan at warm-up for the shapes where that form won, or here on first use).
Not every CPU runs every form: `can_pack` says from the CPU's flags (`CpuInfo`) whether oneDNN takes
this dtype (bf16 needs AVX-512 BW+VL+DQ or AVX-NE-CONVERT, as torch's guard does), and the plan asks
it before it makes a copy or times a form, never the exception torch would raise.

Every form returns a contiguous (rows, out) tensor: what comes next (RMSNorm, RoPE, the K/V write)
may be one of minivllm's C++ kernels, which read each row as one run.

`bound_product(weight, bias, form)` fixes everything but x once and returns the product as one call: the
plan keeps one per layer and row count (matmul_plan.py), so a decode step, which runs ~120 products of a
few microseconds' Python each, does not decide the form again on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
import torch.nn.functional as F

from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.kernels.skinny_gemm import pack_skinny_weight, skinny_gemm
from minivllm.cpu.cpu_info import CpuInfo


Product = Callable[[torch.Tensor], torch.Tensor]  # x (rows, in) -> x W^T + b (rows, out), W and b fixed


class MatmulForm(Enum):
    LINEAR = "x W^T"
    WEIGHT_LEFT = "(W x^T)^T"
    PACKED = "packed"
    SKINNY = "skinny"
    WIDENED = "widened"


WIDENED_FROM_ROWS = 5  # the first row count where WIDENED is the untimed default (a row bucket's start: 5-16)
WIDEN_BLOCK_BYTES = 2 << 20  # fp32 bytes of weight rows widened at once: reused memory, not a fresh mmap


def widens(dtype: torch.dtype, cpu: CpuInfo) -> bool:
    """Whether WIDENED is a form worth running for `dtype` on `cpu`: bf16 where oneDNN cannot take it."""
    return dtype is torch.bfloat16 and not cpu.onednn_bf16


def default_form(dtype: torch.dtype, cpu: CpuInfo, rows: int) -> MatmulForm:
    """The form a product of `rows` rows runs when nothing was timed (tuning off, weights within L2, a
    bucket no other form competes in): WIDENED for bf16 without oneDNN's bf16 from 5 rows, else LINEAR.
    It is also the baseline the timed forms must beat by the tuner's margin."""
    return MatmulForm.WIDENED if widens(dtype, cpu) and rows >= WIDENED_FROM_ROWS else MatmulForm.LINEAR


def matmul(x: torch.Tensor, weight: torch.Tensor, form: MatmulForm) -> torch.Tensor:
    """x (rows, in) times weight (out, in)^T -> (rows, out), computed in the given form."""
    if form is MatmulForm.LINEAR:
        return F.linear(x, weight)
    if form is MatmulForm.PACKED:
        return packed_linear(x, weight)
    if form is MatmulForm.SKINNY:
        return skinny_linear(x, weight)
    if form is MatmulForm.WIDENED:
        return widened_linear(x, weight)
    if x.shape[0] == 1:  # W @ (one column) would take the gemv path: two columns, keep the first
        # `[:, :1].t()` alone is a strided view (stride (1, 2)); the next op (the C++ norm, RoPE and K/V-write
        # kernels read each row as one contiguous run) must get the row as every other form returns it.
        return (weight @ torch.cat([x, x]).t())[:, :1].t().contiguous()  # (1, out)
    return (weight @ x.t()).t().contiguous()  # (rows, out)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b computed in fp32 on widened copies of x, W and b, rounded once to x's dtype. W is widened
    a block of `WIDEN_BLOCK_BYTES` of output rows at a time (the fp32 GEMM per block is as fast as one
    over the whole weight, and the block's memory is reused instead of faulted in per call)."""
    out_features, in_features = weight.shape
    x32 = x.float()  # (rows, in)
    b32 = None if bias is None else bias.float()
    step = max(1, WIDEN_BLOCK_BYTES // (4 * in_features))  # output rows per block
    if step >= out_features:
        return F.linear(x32, weight.float(), b32).to(x.dtype)  # (rows, out)
    y = x.new_empty(x.shape[0], out_features)  # (rows, out), in x's dtype
    for lo in range(0, out_features, step):
        hi = min(lo + step, out_features)
        y[:, lo:hi] = F.linear(x32, weight[lo:hi].float(), None if b32 is None else b32[lo:hi])  # rounded here
    return y


def can_pack(weight: torch.Tensor, cpu: CpuInfo) -> bool:
    """Whether `pack` (and so the PACKED form) runs for this weight on `cpu`: oneDNN packs fp32 anywhere
    it is built, bf16 only where torch's guard lets it (`cpu.onednn_bf16`; elsewhere torch raises "bf16
    path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"). Checked here, from
    the flags, so the plan never tries a form this CPU cannot run; never fp16."""
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and (weight.dtype is torch.float32 or (weight.dtype is torch.bfloat16 and cpu.onednn_bf16)))


def pack(weight: torch.Tensor) -> None:
    """Keep a copy of `weight` in oneDNN's blocked layout as `weight.packed` (an opaque mkldnn tensor,
    only for `packed_linear`), the way vLLM sets attributes on its parameters."""
    with torch.no_grad():
        weight.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b through oneDNN with the packed copy of W (packed now, once, if the plan has not)."""
    if getattr(weight, "packed", None) is None:
        pack(weight)
    return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")  # (rows, out)


def pack_skinny(weight: torch.Tensor) -> None:
    """Keep a copy of `weight` in the skinny kernel's layout of 16-column blocks as `weight.skinny`."""
    with torch.no_grad():
        weight.skinny = pack_skinny_weight(weight)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b through minivllm's skinny kernel (its copy of W laid out now, once, if the plan has not)."""
    return skinny_gemm(x, _skinny_copy(weight), weight.shape[0], bias)  # (rows, out)


def _skinny_copy(weight: torch.Tensor) -> torch.Tensor:
    if getattr(weight, "skinny", None) is None:  # first use outside the plan (which packs only where it loaded)
        build = load_cpu_kernels()  # checked here, off the per-step path
        if not build.available:
            raise RuntimeError(f"the {MatmulForm.SKINNY.name} matmul form needs minivllm's CPU kernels, "
                               f"{build.detail}")
        pack_skinny(weight)
    return weight.skinny


def bound_product(weight: torch.Tensor, bias: torch.Tensor | None, form: MatmulForm) -> Product:
    """x -> x W^T + b in `form`, with the rest looked up now: the packed copy (made now if missing), the
    output size, the bias. The skinny and packed products call their C++ op directly (the op's overload,
    not the Python wrappers above), so between a layer and its kernel there is one Python call."""
    if form is MatmulForm.SKINNY:
        packed = _skinny_copy(weight)  # first: it loads the kernels, which registers the op
        op, out_features = torch.ops.minivllm_cpu.skinny_gemm.default, weight.shape[0]
        return lambda x: op(x, packed, out_features, bias)
    if form is MatmulForm.PACKED:
        if getattr(weight, "packed", None) is None:
            pack(weight)
        op, packed = torch.ops.mkldnn._linear_pointwise.default, weight.packed
        return lambda x: op(x, packed, bias, "none", [], "")
    if form is MatmulForm.LINEAR:
        return lambda x: F.linear(x, weight, bias)  # the bias fused in
    if form is MatmulForm.WIDENED:
        return lambda x: widened_linear(x, weight, bias)  # the bias added in fp32, before the rounding
    if bias is None:
        return lambda x: matmul(x, weight, form)
    return lambda x: matmul(x, weight, form) + bias
