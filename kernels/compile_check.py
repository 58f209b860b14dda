"""Compiling minivllm's C++ CPU kernels for an instruction-set level this machine may not run, loading nothing.

    python -m minivllm.kernels.compile_check [--cannot-run] x86-64-v4 amx

A CI machine with AVX2 only cannot run the AVX-512 or AMX / avx512_bf16 paths (cpu_build.py builds and
tests the levels it can run), but it can compile them: this proves that code still builds (every
intrinsic declared, every target option right) after an edit made on another machine. It compiles, with the
real build's flags plus the level's, only the sources that have code for the level (those that test one
of its macros, in the file or a minivllm header it includes), in parallel, into object files in a
temporary folder; nothing is linked or loaded. Running those paths needs a CPU that has them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.utils.cpp_extension import get_cxx_compiler, include_paths

from .cpu_build import HEADERS, LIBRARY, SOURCES, _cause  # one dot: kernels/ imports nothing from minivllm

# level -> (its flags, the macros that mark code for it). No kernel has AMX tile code yet: the amx level
# compiles the avx512_bf16 paths (-march=sapphirerapids enables both).
COMPILE_ONLY = {"x86-64-v4": (["-march=x86-64-v4"], ("__AVX512F__",)),
                "amx": (["-march=sapphirerapids"], ("__AMX_TILE__", "__AMX_BF16__", "__AVX512BF16__"))}
# level -> the CPU flags with which the native build (-march=native) already compiles all of its code.
NATIVE_COVERS = {"x86-64-v4": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "amx": {"avx512_bf16", "amx_tile"}}


def native_build_covers(level: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has what `level`'s code needs, so the native build (which CI builds and tests anyway)
    compiles that code already and compiling it again here would only cost time."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((set(line.partition(":")[2].split()) for line in text.splitlines()
                  if line.partition(":")[0].strip() == "flags"), set())
    return NATIVE_COVERS[level] <= flags


def compile_only_sources(level: str) -> tuple[str, ...]:
    """The sources with code for a compile-only level: those that test one of its macros (a file without
    AVX-512 code would compile at -march=x86-64-v4 to what the native build already checks)."""
    here, macros = Path(__file__).parent, COMPILE_ONLY[level][1]
    headers = {h: (here / h).read_text() for h in HEADERS}

    def text(source: str) -> str:  # the source and the minivllm headers it includes
        body = (here / source).read_text()
        return body + "".join(t for h, t in headers.items() if f'#include "{h}"' in body)
    return tuple(source for source in SOURCES if any(m in text(source) for m in macros))


def compile_only(level: str, out_dir: Path, jobs: int | None = None) -> tuple[str, ...]:
    """Compile the kernels' sources for `level` (a key of COMPILE_ONLY) into object files under `out_dir`,
    with the real build's flags and nothing loaded or run: code this machine cannot run (AVX-512, AMX on an
    AVX2 CI machine) at least builds. Returns the sources compiled; raises RuntimeError with the compiler's
    error lines if one fails."""
    sources, here = compile_only_sources(level), Path(__file__).parent
    flags = ["-std=c++20", "-fPIC", "-O3", "-fopenmp", *COMPILE_ONLY[level][0], f"-DMINIVLLM_CPU_LIBRARY={LIBRARY}",
             *(f"-isystem{path}" for path in include_paths())]

    def compile_one(source: str) -> str:
        out = out_dir / f"{Path(source).stem}.{level}.o"
        run = subprocess.run([get_cxx_compiler(), *flags, "-c", str(here / source), "-o", str(out)],
                             capture_output=True, text=True)
        return "" if run.returncode == 0 else f"{source}: {_cause(run.stderr or run.stdout)}"

    out_dir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        failures = [f for f in pool.map(compile_one, sources) if f]
    if failures:
        raise RuntimeError(f"the kernels do not compile for {level}: " + "; ".join(failures))
    return sources


def main(argv: list[str] | None = None) -> int:
    """`python -m minivllm.kernels.compile_check x86-64-v4 [amx]`: compile for those levels, load nothing."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("levels", nargs="+", choices=sorted(COMPILE_ONLY), metavar="LEVEL",
                        help=f"levels to compile for without loading: {', '.join(sorted(COMPILE_ONLY))}")
    parser.add_argument("--cannot-run", action="store_true",
                        help="only the levels this CPU cannot run (the native build compiles the others)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="minivllm-compile-only-") as tmp:
        for level in args.levels:
            if args.cannot_run and native_build_covers(level):
                print(f"{level}: this CPU runs it, so the native build compiles its code; not compiled again")
                continue
            start = time.monotonic()
            try:
                sources = compile_only(level, Path(tmp))
            except RuntimeError as error:
                print(error, file=sys.stderr)
                return 1
            print(f"{level} ({' '.join(COMPILE_ONLY[level][0])}): {', '.join(sources)} compile "
                  f"({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
