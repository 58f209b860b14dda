"""`CpuInfo`: what a CPU is called and what it computes natively, read once from /proc/cpuinfo and /sys.

The matmul plan (matmul_plan.py) and int8 quantization (layers/quantization.py) print it beside what they chose,
the dtype rule reads `native_bf16` and `x86_64_v3` (engine/worker/loading.py: bf16 weights wherever a kernel
path reads them), the matmul forms read `onednn_bf16` (a form the CPU cannot run is never tried:
matmul_forms.py `can_pack`; where oneDNN takes no bf16, a bf16 product is widened to fp32), and the
tuning cache (tuning_cache.py) keys its file with the model name: a choice timed on one CPU is no
evidence about another.

Invariants:
  * What minivllm believes about the CPU is what its ISA level lets it see (kernels/cpu_build.py): under
    MINIVLLM_CPU_ISA=avx2 every AVX-512 / AMX / AVX-VNNI / avx_ne_convert flag is absent here, so an
    AVX-512 machine answers every question (`native_bf16`, `amx`, `vnni`, `onednn_bf16`) as an AVX2 laptop;
    under MINIVLLM_CPU_ISA=portable AVX2, FMA and F16C are hidden too (`x86_64_v3` is False).
  * Each flag-derived answer is a plain bool field, so a test can hand the plan or the dtype rule the CPU
    it wants to exercise (`CpuInfo("an AVX2 laptop", amx=False, ...)`); the defaults are the safe ones.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from minivllm.kernels.cpu_build import hides_flag, isa_level

# oneDNN's ISA levels at or above the one torch's bf16 guard asks for, each with the /proc/cpuinfo flags
# oneDNN's `mayiuse` tests for it (src/cpu/x64/cpu_isa_traits.hpp): "avx512_core" is AVX-512 F+BW+VL+DQ,
# "avx2_vnni_2" is AVX2 with AVX-VNNI, AVX-VNNI-INT8 and AVX-NE-CONVERT (Intel's 2023+ cores without AVX-512).
ONEDNN_BF16_LEVELS = {"avx512_core": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
                      "avx2_vnni_2": frozenset({"avx2", "avx_vnni", "avx_vnni_int8", "avx_ne_convert"})}


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    amx: bool  # Intel Advanced Matrix Extensions (amx_tile): oneDNN's bf16/int8 tile kernels
    avx512_bf16: bool
    last_level_cache_bytes: int
    vnni: bool = False  # int8 dot products summed in 32 bits (avx512_vnni / avx_vnni): fbgemm's int8 kernels
    l2_cache_bytes: int = 1 << 20  # one core's own: unlike the last level, a VM guest's is not the host's share
    # Whether torch lets oneDNN take bf16 here (`onednn_runs_bf16`): its prepacked linear (the PACKED form)
    # raises "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq" where not.
    # False by default: a CpuInfo made by hand never leads to that call.
    onednn_bf16: bool = False
    # AVX2 + FMA + F16C (x86-64-v3's vector part; every AVX-512 CPU has them too): minivllm's kernels have
    # an 8-lane path here that widens bf16 weights to fp32 in registers (kernels/skinny_gemm.cpp), so bf16
    # weights stream half the bytes of fp32 ones. False by default, like the other answers.
    x86_64_v3: bool = False

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU computes bf16 in hardware (AMX tiles or AVX-512 BF16 dot products); without
        either, oneDNN converts bf16 to fp32 in software and bf16 gains nothing but half the bytes.
        Not the same set as `onednn_bf16`: an AVX-512 CPU without avx512_bf16 (Skylake-SP) runs oneDNN's
        bf16 path, converting in software; an AVX2-only one (Zen 3) runs neither."""
        return self.amx or self.avx512_bf16

    @classmethod
    def read(cls) -> CpuInfo:
        """From /proc/cpuinfo and /sys (Linux); elsewhere `platform.processor()` and a 32 MiB guess.
        Flags hidden at minivllm's ISA level (MINIVLLM_CPU_ISA) count as absent."""
        name, flags = platform.processor() or "unknown CPU", set()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() in ("flags", "Features"):  # x86-64, arm64
                    flags = set(value.split())
                    break  # the first processor is enough
        except OSError:
            pass
        level = isa_level()
        flags = {flag for flag in flags if not hides_flag(flag, level)}
        return cls(name, "amx_tile" in flags, "avx512_bf16" in flags, _cache_bytes(),
                   vnni=bool(flags & {"avx512_vnni", "avx_vnni"}),
                   l2_cache_bytes=_cache_bytes(level=2, default=1 << 20),
                   onednn_bf16=onednn_runs_bf16(frozenset(flags), platform.machine(), _onednn_max_isa()),
                   x86_64_v3={"avx2", "fma", "f16c"} <= flags)

    def __str__(self) -> str:
        yes_no = {True: "yes", False: "no"}
        # Two lines: a CPU's name can be 50 characters, and a printed line must fit the docs site (100).
        return (f"CPU: {self.model_name}\n  AVX2+FMA: {yes_no[self.x86_64_v3]}, AMX: {yes_no[self.amx]}, "
                f"avx512_bf16: {yes_no[self.avx512_bf16]}, oneDNN bf16: {yes_no[self.onednn_bf16]}, "
                f"last-level cache {self.last_level_cache_bytes >> 20} MiB")


def onednn_runs_bf16(flags: frozenset[str], machine: str, max_isa: str) -> bool:
    """torch's guard on oneDNN's bf16 ops, `mkldnn_bf16_device_check()` (aten/src/ATen/native/mkldnn/
    Utils.h), restated over /proc/cpuinfo flags. On x86-64 it is `ideep::has_bf16_type_support()`
    (ideep/abstract_types.hpp): `dnnl::get_effective_cpu_isa() >= dnnl::cpu_isa::avx2_vnni_2`, i.e. oneDNN
    may use avx2_vnni_2 or avx512_core (every level above includes avx512_core); on arm64 it is cpuinfo's
    `cpuinfo_has_arm_bf16()` (the "bf16" feature). `max_isa` is oneDNN's own cap (ONEDNN_MAX_CPU_ISA): an
    ISA is usable only where the cap's bit mask holds all of that ISA's bits, so "AVX2_VNNI_2" allows the
    first, "AVX512_*" / "AVX10_*" the second, "AVX2" and below neither, "" / "ALL" / "DEFAULT" both."""
    if machine in ("aarch64", "arm64"):
        return "bf16" in flags
    cap = max_isa.strip().upper()
    allowed = {"avx2_vnni_2"} if cap == "AVX2_VNNI_2" else (
        {"avx512_core"} if cap.startswith(("AVX512", "AVX10")) else
        set() if cap in ("SSE41", "AVX", "AVX2", "AVX2_VNNI") else set(ONEDNN_BF16_LEVELS))
    return any(ONEDNN_BF16_LEVELS[level] <= flags for level in allowed)


def _onednn_max_isa() -> str:
    """oneDNN's cap on its instruction set, as it reads it (ONEDNN_ first, then the older DNNL_ name)."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""


def _cache_bytes(level: int | None = None, default: int = 32 << 20) -> int:
    """The largest cache of cpu0 (of that `level` if given), from /sys; `default` where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()  # e.g. "32768K"
            if level is not None and int((index / "level").read_text()) != level:
                continue
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
        sizes.append(int(size.rstrip("KM")) * scale)
    return max(sizes, default=default)
