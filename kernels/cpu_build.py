"""Building minivllm's C++ CPU kernels: one extension, compiled on first use for the CPU at hand.

    skinny_gemm.cpp             x W^T for a few rows (the matmul plan's SKINNY form)
    paged_decode_attention.cpp  decode attention that reads K/V where they lie in the paged cache
    kv_cache_write.cpp          the new tokens' K/V rows into their slots (one memcpy a row)
    greedy_argmax.cpp           each row's argmax, straight from bf16 or fp32 logits
    rms_norm.cpp                RMSNorm (and the residual add before it) in one pass over each row
    rotary_embedding.cpp        RoPE over a step's heads, reading the cos / sin tables at each position
    silu_and_mul.cpp            the MLP's silu(gate) * up in one pass

They share the float32 / bfloat16 helpers of cpu_simd.h and register their ops under one library,
`torch.ops.minivllm_cpu`. `load_cpu_kernels()` compiles them with torch.utils.cpp_extension (ninja and the
system's C++ compiler; ~20-70 s on 2 cores the first time; later the library is loaded as it is) with
-march=native, i.e. for the machine that runs them: AVX-512 paths where the CPU has them, AVX2 + FMA or
plain loops elsewhere (each kernel's header says which paths it has). MINIVLLM_CPU_ISA caps the level:
"avx2" (x86-64-v3) or "portable" (x86-64, the plain loops), also hiding the flags above it from CpuInfo.
The build folder is named after the level and a digest of everything the binary depends on: this
CPU's instruction-set flags, torch's version, the sources and headers, and the flags. So a home directory
shared with a different CPU, or two checkouts of different minivllm versions, never load each other's build
(a binary from other sources would compute something else, quietly).

Several processes at once (two notebooks, tensor-parallel ranks, a test beside a server) take turns:
one builds while the others wait on an OS file lock (`flock`), which the kernel releases when its
holder exits, killed or not, so no lock outlives a build. The build happens in a folder of the
builder's own, moved into place when done: a build killed half-way (whose compilers may run on a
little) never shares a folder with the next one. The wait is bounded (`BUILD_WAIT_S`); a process
that waited that long runs without the kernels and says why. A compile prints a line with its
expected duration, then one every `PROGRESS_EVERY_S` seconds: a first start is never silent for long.

It never raises. Where the kernels cannot be built (no compiler, not Linux x86-64 / arm64, a compile
error, a build held by another process for too long) it logs a warning with the reason and returns a
`CpuKernelsBuild` saying why; the engine then runs without them (torch's own kernels), and
`minivllm bench` prints the reason.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

# included by the sources: helpers; decode attention's shared vector pieces and dispatch, then its two paths
HEADERS = ("cpu_simd.h", "paged_decode_simd.h", "paged_decode_avx512.h", "paged_decode_avx2.h")
SOURCES = ("skinny_gemm.cpp", "paged_decode_attention.cpp", "kv_cache_write.cpp", "greedy_argmax.cpp", "rms_norm.cpp",
           "rotary_embedding.cpp", "silu_and_mul.cpp")
LIBRARY = "minivllm_cpu"
BUILD_WAIT_S = 900.0  # the longest wait for another process's build: ~1 min on 2 idle cores, several on a busy one
PROGRESS_EVERY_S = 10.0
ISA_ENV = "MINIVLLM_CPU_ISA"  # unset: native; "avx2" / "portable": run this machine as a lesser x86-64 one
# The levels minivllm builds for. Each kernel has a path per level (its header says which): AVX-512 (and
# avx512_bf16 where the CPU has it) under "native" on such a CPU, AVX2 + FMA under "avx2", the plain loops
# under "portable" (SSE2, what any x86-64 has, and what any C++17 compiler builds).
ISA_CFLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3"], "portable": ["-march=x86-64"]}
ISA_ALIASES = {"x86-64-v3": "avx2", "x86-64": "portable"}  # the compilers' names for the same levels
# What a capped level hides from minivllm's view of the CPU (minivllm's CpuInfo reads this too): what the
# level's -march does not enable. x86-64-v3 adds AVX, AVX2, FMA, F16C, BMI1/2, LZCNT (abm), MOVBE to
# x86-64-v2's SSE3 (pni), SSSE3, SSE4.1/4.2, POPCNT, CX16, LAHF.
_ABOVE_V3 = frozenset({"avx512*", "amx*", "avx_ne_convert", "avx_vnni*"})
_V2_AND_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "pni", "ssse3", "sse4_1",
                        "sse4_2", "popcnt", "cx16", "lahf_lm"})
ISA_HIDDEN_FLAGS = {"native": frozenset(), "avx2": _ABOVE_V3, "portable": _ABOVE_V3 | _V2_AND_V3}
# The CPU flags a level's build needs: a capped level the CPU cannot run is not built (the loader says so
# and builds for the CPU instead).
ISA_NEEDS = {"native": frozenset(), "avx2": frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"}),
             "portable": frozenset()}


def isa_level() -> str:
    """The instruction-set level minivllm builds for and believes in: "native" (the CPU at hand), "avx2"
    (MINIVLLM_CPU_ISA=avx2 or x86-64-v3: built for -march=x86-64-v3 and every AVX-512 / AMX flag hidden, so
    an AVX-512 machine runs the paths a student's AVX2 laptop runs) or "portable" (=x86-64: SSE2 only, the
    plain loops, and a CPU that reports no AVX at all). Read at each call: tests set it per process."""
    raw = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    level = ISA_ALIASES.get(raw, raw)
    if level not in ISA_CFLAGS:
        known = sorted([*ISA_CFLAGS, *ISA_ALIASES])
        raise ValueError(f"{ISA_ENV}={raw!r} is not a level minivllm knows; use one of {known} (or unset it)")
    return level


def hides_flag(flag: str, level: str) -> bool:
    """Whether `flag` (a /proc/cpuinfo flag) is hidden at `level`."""
    return any(flag == p or (p.endswith("*") and flag.startswith(p[:-1])) for p in ISA_HIDDEN_FLAGS[level])


def isa_cflags(level: str | None = None) -> list[str]:
    """The instruction-set flags of a level's build (this process's level, `isa_level`, by default)."""
    return ISA_CFLAGS[isa_level() if level is None else level]


def build_level() -> str:
    """The level this process's kernels are built for: `isa_level`, unless this CPU cannot run that level's
    code (MINIVLLM_CPU_ISA=avx2 on a CPU without AVX2 or not x86-64): then "native", which never asks for
    more than the CPU has. (Any level is fine to compile; only running it needs the CPU.)"""
    level = isa_level()
    if level == "native" or (platform.machine() == "x86_64" and ISA_NEEDS[level] <= _cpu_flags()):
        return level
    return "native"


def _cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo lists them (all of them: nothing hidden)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


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
        level = build_level()
        if level != isa_level():
            log.warning("%s=%s asks for code this CPU cannot run: building the kernels for this CPU instead",
                        ISA_ENV, os.environ.get(ISA_ENV))
        flags = isa_cflags(level)
        name = build_name(level)
        log.info("loading minivllm's CPU kernels %s (compiled the first time on this machine)", name)
        build_cpu_kernels(name, flags)
    except Exception as error:  # no compiler, no ninja, a compile error: the engine runs without them
        text = str(error).strip() or type(error).__name__
        log.warning("minivllm's CPU kernels could not be built; running on torch's kernels instead:\n%s", text)
        return CpuKernelsBuild(False, f"not built ({type(error).__name__}: {_cause(text)})")
    return CpuKernelsBuild(True, f"built for ISA level {level} ({' '.join(flags)}) as {name}")


def build_name(level: str) -> str:
    """The build folder (and extension) of a level: the level, then the digest of what the binary depends on,
    so the builds of two levels sit side by side and never overwrite each other."""
    return f"minivllm_cpu_kernels_{level}_{build_key(tuple(isa_cflags(level)))}"


def build_cpu_kernels(name: str, cflags: list[str], library: str = LIBRARY, wait_s: float = BUILD_WAIT_S,
                      sources: tuple[str, ...] = SOURCES) -> None:
    """Compile the kernels as extension `name` with `cflags` (the instruction set) and load them; their
    ops are torch.ops.<library>.*. The tests build the non-AVX-512 paths this way under other names (and
    a path only one kernel has from its own source alone: `sources`, a subset of SOURCES).
    Raises TimeoutError if another process holds the folder's build lock for more than `wait_s` seconds."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "minivllm"
    root.mkdir(parents=True, exist_ok=True)
    build_dir = root / name
    with _exclusive(root / f"{name}.lock", wait_s):
        built = build_dir / f"{name}.so"
        if built.exists():
            # Its name is the digest of everything it was built from (build_key), so it is up to date by
            # construction: load it as it is. torch's `load` would run ninja first, and ninja rebuilds, silently,
            # a folder last built from another checkout's source paths (same sources, other paths).
            torch.ops.load_library(str(built))
            return
        # Compile in a folder of this process's own, then move it into place: a build killed half-way leaves
        # its folder (and the compilers it started, which outlive it a little) to itself, never the final one.
        for leftover in [build_dir, *root.glob(f"{name}.building-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        staging = root / f"{name}.building-{os.getpid()}"
        staging.mkdir()
        # Short lines: a notebook that happens to build them shows this message on the docs site.
        with _progress(f"minivllm: compiling the C++ CPU kernels for this CPU (first use with these\n"
                       f"  sources; ~20-70 s on 2 cores, later starts load them at once)\n  into {build_dir}"):
            _load(name, cflags, library, staging, sources)
        staging.rename(build_dir)


def _load(name: str, cflags: list[str], library: str, build_dir: Path, sources: tuple[str, ...]) -> None:
    from torch.utils.cpp_extension import load

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
    headers = _digest(HEADERS)
    try:
        load(name, [str(here / source) for source in sources],
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


def _digest(files: tuple[str, ...]) -> str:
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / f).read_bytes() for f in files)).hexdigest()[:12]


def build_key(cflags: tuple[str, ...] | None = None) -> str:
    """A digest of what the binary depends on: this CPU's instruction-set flags (the build is -march=native),
    torch's version, the machine, the sources and headers, and the flags. The build folder is named after
    it, and the tuning cache (minivllm/cpu/tuning_cache.py) keys its timings with it: a timing of other
    kernels, or on another CPU, says nothing about these."""
    cflags = tuple(isa_cflags()) if cflags is None else cflags
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                flags = line
                break
    except OSError:
        pass
    text = f"{flags}|{torch.__version__}|{os.uname().machine}|{_digest(SOURCES + HEADERS)}|{' '.join(cflags)}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@contextmanager
def _exclusive(path: Path, wait_s: float) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (waiting at most `wait_s` seconds for another process to let go).
    The OS releases it when the holder exits, however it exits: no stale lock to clean up. Opened with
    O_NOFOLLOW: a symbolic link planted there raises (ELOOP) instead of creating or locking its target."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "r+") as f:
        start, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= wait_s:
                    raise TimeoutError(f"another process has been building minivllm's CPU kernels in {path.parent} "
                                       f"for more than {wait_s:g} s") from None
                if not said and waited > 2:  # not a mere load (a second) by another rank: say why we wait
                    print(f"minivllm: waiting for another process that is building the C++ CPU kernels "
                          f"(at most {wait_s:g} s)", file=sys.stderr, flush=True)
                    said = True
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _progress(message: str) -> Iterator[None]:
    """Print `message`, then the time spent every PROGRESS_EVERY_S seconds until the block ends, and that it is
    done if it ends without an error."""
    print(message, file=sys.stderr, flush=True)
    done, start = threading.Event(), time.monotonic()

    def tick() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            print(f"minivllm: still compiling the CPU kernels ({time.monotonic() - start:.0f} s)", file=sys.stderr,
                  flush=True)

    ticker = threading.Thread(target=tick, name="minivllm-build-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    print(f"minivllm: the CPU kernels are built ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

