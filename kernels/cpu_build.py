"""Building minivllm's C++ CPU kernels: one extension, compiled on first use for the CPU at hand.

    skinny_gemm.cpp             x W^T for a few rows (the matmul plan's SKINNY form)
    paged_decode_attention.cpp  decode attention that reads K/V where they lie in the paged cache
    kv_cache_write.cpp          the new tokens' K/V rows into their slots (one memcpy a row)
    greedy_argmax.cpp           each row's argmax, straight from bf16 or fp32 logits
    rms_norm.cpp                RMSNorm (and the residual add before it) in one pass over each row
    rotary_embedding.cpp        RoPE over a step's heads, reading the cos / sin tables at each position

They share the float32 / bfloat16 helpers of cpu_simd.h and register their ops under one library,
`torch.ops.minivllm_cpu`. `load_cpu_kernels()` compiles them with torch.utils.cpp_extension (ninja and the
system's C++ compiler; ~15-20 s the first time, then cached) with -march=native, i.e. for the machine that
runs them: AVX-512 paths where the CPU has them, plain loops the compiler vectorises elsewhere. The
build folder is named after this CPU's instruction-set flags, so a home directory shared with a
different CPU builds its own copy.

It never raises. Where the kernels cannot be built (no compiler, not Linux x86-64 / arm64, a compile
error) it logs a warning with the compiler's message and returns a `CpuKernelsBuild` saying why; the
engine then runs without them (torch's own kernels), and `minivllm bench` prints the reason. A build
interrupted half-way (Ctrl-C, a kill) leaves a lock file that would make every later build wait for
ever; one older than `STALE_LOCK_S` is removed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

HEADERS = ("cpu_simd.h",)  # included by the sources: the float32 / bfloat16 helpers they share
SOURCES = ("skinny_gemm.cpp", "paged_decode_attention.cpp", "kv_cache_write.cpp", "greedy_argmax.cpp", "rms_norm.cpp",
           "rotary_embedding.cpp")
LIBRARY = "minivllm_cpu"
STALE_LOCK_S = 300  # a build takes ~20 s; a lock file this old was left by a build that died


@dataclass(frozen=True)
class CpuKernelsBuild:
    """Whether the compiled kernels are loaded in this process; `detail` says why not, or which build."""

    available: bool
    detail: str


@cache  # the op library is registered once per process (torch.ops is process-wide), so is this answer
def load_cpu_kernels() -> CpuKernelsBuild:
    """Compile (first time on this machine) and load the kernels; never raises."""
    if hasattr(torch.ops, LIBRARY) and hasattr(getattr(torch.ops, LIBRARY), "skinny_gemm"):
        return CpuKernelsBuild(True, "already loaded")
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return CpuKernelsBuild(False, f"built only on Linux x86-64 / arm64, not {sys.platform} {platform.machine()}")
    log = logging.getLogger("minivllm")
    try:
        name = f"minivllm_cpu_kernels_{_machine_key()}"
        log.info("loading minivllm's CPU kernels %s (compiled the first time on this machine, ~15-20 s)", name)
        build_cpu_kernels(name, ["-march=native"])
    except Exception as error:  # no compiler, no ninja, a compile error: the engine runs without them
        text = str(error).strip() or type(error).__name__
        log.warning("minivllm's CPU kernels could not be built; running on torch's kernels instead:\n%s", text)
        return CpuKernelsBuild(False, f"not built ({type(error).__name__}: {_cause(text)})")
    return CpuKernelsBuild(True, f"built for this CPU as {name}")


def build_cpu_kernels(name: str, cflags: list[str], library: str = LIBRARY) -> None:
    """Compile the kernels as extension `name` with `cflags` (the instruction set) and load them; their
    ops are torch.ops.<library>.*. The tests build the non-AVX-512 paths this way under other names."""
    from torch.utils.cpp_extension import get_default_build_root, load

    build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "minivllm" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"  # torch's FileBaton: a concurrent build (another rank) holds it ~20 s
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logging.getLogger("minivllm").warning("removing %s, left by an interrupted build", lock)
            lock.unlink()
    except FileNotFoundError:
        pass
    here = Path(__file__).parent
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when its venv's bin/ is not on PATH
        import ninja  # a dependency of minivllm

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path  # for torch's build only; restored below
    # -fopenmp: at::parallel_for is inlined from torch's headers as an OpenMP loop. The extension links
    # libgomp.so.1, the soname torch's bundled copy has, so the one runtime already loaded (and
    # torch.set_num_threads) serves both.
    # torch rebuilds when a source or a flag changes, but does not read the headers: their digest goes into
    # the flags, so editing cpu_simd.h rebuilds too.
    headers = hashlib.sha256(b"".join((here / h).read_bytes() for h in HEADERS)).hexdigest()[:12]
    try:
        load(name, [str(here / source) for source in SOURCES],
             extra_cflags=["-O3", "-fopenmp", *cflags, f"-DMINIVLLM_CPU_LIBRARY={library}",
                           f"-DMINIVLLM_HEADERS_DIGEST={headers}"],
             extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path


def _cause(text: str) -> str:
    """The informative part of a build failure: the compiler's `error:` lines (or the shell's "not found"
    for a missing compiler), else the last line (the first is ninja's command line)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower() or line.endswith("not found")]
    return "; ".join(errors[-2:] or lines[-1:])[:300]


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
