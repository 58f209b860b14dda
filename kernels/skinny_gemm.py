"""`skinny_gemm`: y = x W^T + b for a few rows of x on CPU, as one pass over a re-laid-out weight.

A decode step multiplies 1-16 rows by every weight of the model, so it is bound by streaming the
weights from memory: each weight byte is used once per row. On 2 AMD EPYC cores torch's kernels
streamed a bf16 weight at 11-21 GB/s (`F.linear` / oneDNN's packed weight) where a plain `sum()`
reads the same bytes at 40-55 GB/s. Two things cost the difference:

  * row-major W (out, in) makes every output a dot product of two long vectors, which ends in a
    horizontal sum of a 16-lane register. With in = 576 that sum costs as much as the loop before it.
  * a weight of a few hundred KB is over before the hardware prefetchers are up to speed unless the
    kernel reads it as ONE sequential stream.

So `pack_skinny_weight` lays W out in blocks of 16 output columns, each block contiguous (the C++
file's header draws it), and the kernel broadcasts `x[m][k]` against a 16-wide slice of W: 16 outputs
advance per load, no horizontal sums, one front-to-back read of the weight per call, shared by up to
4 rows. bf16 weights are paired along k so one AVX-512 BF16 dot-product instruction does 32 MACs.

The C++ (skinny_gemm.cpp, beside this file) is compiled on first use by torch.utils.cpp_extension
(ninja and a C++ compiler: about 15 s, then cached) with -march=native, i.e. for the machine that runs
it; the build folder is named after this CPU's instruction-set flags, so a home directory shared with a
different CPU builds its own copy. Where it cannot be built (no compiler, not Linux/x86-64 or arm64, ...)
`load_skinny_gemm` logs why (a warning) and says it in the matmul plan's summary, and the plan simply
does not offer the form (layers/matmul_plan.py). A build interrupted half-way (Ctrl-C, a kill) leaves
a lock file that would make every later build wait for ever; one older than `STALE_LOCK_S` is removed.

`naive_skinny_gemm` is the plain-PyTorch reference (fp32 accumulation); tests/kernels compare them.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

LANES = 16  # output columns per block (one AVX-512 register of fp32)
STALE_LOCK_S = 300  # a build takes ~15 s; a lock file this old was left by a build that died


@dataclass(frozen=True)
class SkinnyGemmBuild:
    """Whether the compiled kernel is loaded in this process; `detail` says why not, or where from."""

    available: bool
    detail: str


def naive_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: x (rows, in) @ weight (out, in)^T + bias, accumulated in fp32, rounded to x's dtype."""
    y = x.float() @ weight.float().t()  # (rows, out)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_skinny_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in) -> blocks of 16 output columns: fp32 (ceil(out/16), in, 16); bf16
    (ceil(out/16), in/2, 16, 2), k paired. Rows past `out` are zero padding (never written out)."""
    out_features, in_features = weight.shape
    n_blocks = math.ceil(out_features / LANES)
    w = F.pad(weight.detach(), (0, 0, 0, n_blocks * LANES - out_features))  # (n_blocks * 16, in)
    if weight.dtype == torch.float32:
        return w.view(n_blocks, LANES, in_features).transpose(1, 2).contiguous()
    if weight.dtype == torch.bfloat16 and in_features % 2 == 0:
        return w.view(n_blocks, LANES, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    raise ValueError(f"skinny_gemm packs float32, or bfloat16 with an even in_features; got {weight.dtype} "
                     f"({out_features} x {in_features})")


def can_pack_skinny(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and (
        weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0))


def skinny_gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) times the weight packed by `pack_skinny_weight` -> (rows, out_features), + bias.
    Call `load_skinny_gemm()` first (it must say available)."""
    return torch.ops.minivllm_cpu.skinny_gemm(x, packed, out_features, bias)


@cache  # the op library is registered once per process (torch.ops is process-wide), so is this answer
def load_skinny_gemm() -> SkinnyGemmBuild:
    """Compile (first time on this machine) and load the kernel; never raises."""
    if hasattr(torch.ops, "minivllm_cpu") and hasattr(torch.ops.minivllm_cpu, "skinny_gemm"):
        return SkinnyGemmBuild(True, "already loaded")
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return SkinnyGemmBuild(False, f"built only on Linux x86-64 / arm64, not {sys.platform} {platform.machine()}")
    log = logging.getLogger("minivllm")
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
        name = f"minivllm_skinny_gemm_{_machine_key()}"
        log.info("loading the skinny matmul kernel %s (compiled the first time on this machine, ~10-15 s)", name)
        build_skinny_gemm(name, ["-march=native"])
    except Exception as error:  # no compiler, no ninja, a compile error: the plan runs without it
        text = str(error).strip() or type(error).__name__
        log.warning("the skinny matmul kernel could not be built; the matmul plan runs without it:\n%s", text)
        return SkinnyGemmBuild(False, f"not built ({type(error).__name__}: {_cause(text)})")
    return SkinnyGemmBuild(True, f"built for this CPU as {name}")


def _cause(text: str) -> str:
    """The informative part of a build failure: the compiler's `error:` lines, else the last line (the
    first is ninja's command line)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower()]
    return "; ".join(errors[-2:] or lines[-1:])[:300]


def build_skinny_gemm(name: str, cflags: list[str], library: str | None = None) -> None:
    """Compile skinny_gemm.cpp as extension `name` with `cflags` (the instruction set) and load it; its op
    is torch.ops.<library>.skinny_gemm (default minivllm_cpu). The tests build the non-AVX-512 paths
    this way under other library names."""
    from torch.utils.cpp_extension import get_default_build_root, load

    build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "minivllm" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"  # torch's FileBaton: a concurrent build (another rank) holds it ~15 s
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logging.getLogger("minivllm").warning("removing %s, left by an interrupted build", lock)
            lock.unlink()
    except FileNotFoundError:
        pass
    defines = [] if library is None else [f"-DSKINNY_LIBRARY={library}"]
    # -fopenmp: at::parallel_for is inlined from torch's headers as an OpenMP loop. The extension links
    # libgomp.so.1, the soname torch's bundled copy has, so the one runtime already loaded (and
    # torch.set_num_threads) serves both.
    load(name, [str(Path(__file__).with_suffix(".cpp"))], extra_cflags=["-O3", "-fopenmp", *cflags, *defines],
         extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False, verbose=False)


def _machine_key() -> str:
    """A digest of this CPU's instruction-set flags (the build is -march=native) and torch's version."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                flags = line
                break
    except OSError:
        pass
    text = f"{flags}|{torch.__version__}|{os.uname().machine}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]
