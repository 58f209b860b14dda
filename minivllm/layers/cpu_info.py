"""`CpuInfo`: what a CPU is called and what it computes natively, read once from /proc/cpuinfo and /sys.

The matmul plan (matmul_plan.py) and int8 quantization (quantization.py) print it beside what they chose,
the dtype rule reads `native_bf16` (engine/loading.py), and the tuning cache (tuning_cache.py) keys its
file with the model name: a choice timed on one CPU is no evidence about another.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    amx: bool  # Intel Advanced Matrix Extensions (amx_tile): oneDNN's bf16/int8 tile kernels
    avx512_bf16: bool
    last_level_cache_bytes: int
    vnni: bool = False  # int8 dot products summed in 32 bits (avx512_vnni / avx_vnni): fbgemm's int8 kernels
    l2_cache_bytes: int = 1 << 20  # one core's own: unlike the last level, a VM guest's is not the host's share

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU computes bf16 in hardware (AMX tiles or AVX-512 BF16 dot products); without
        either, oneDNN converts bf16 to fp32 in software and bf16 gains nothing but half the bytes."""
        return self.amx or self.avx512_bf16

    @classmethod
    def read(cls) -> "CpuInfo":
        """From /proc/cpuinfo and /sys (Linux); elsewhere `platform.processor()` and a 32 MiB guess."""
        name, flags = platform.processor() or "unknown CPU", set()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break  # the first processor is enough
        except OSError:
            pass
        return cls(name, "amx_tile" in flags, "avx512_bf16" in flags, _cache_bytes(),
                   vnni=bool(flags & {"avx512_vnni", "avx_vnni"}),
                   l2_cache_bytes=_cache_bytes(level=2, default=1 << 20))

    def __str__(self) -> str:
        yes_no = {True: "yes", False: "no"}
        return (f"CPU: {self.model_name} (AMX: {yes_no[self.amx]}, avx512_bf16: {yes_no[self.avx512_bf16]}, "
                f"last-level cache {self.last_level_cache_bytes >> 20} MiB)")


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
