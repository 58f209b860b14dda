"""kernels/cpu_build.py's ISA levels (native, avx2, portable): their names, what each hides from minivllm's
view of the CPU, their build folders, and the code paths this CPU does not run by default, built here under
other op-library names and compared with the naive references (and with each other, bit for bit)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from minivllm.kernels import cpu_build
from minivllm.kernels.cpu_build import build_cpu_kernels, build_key, build_level, build_name, hides_flag, isa_level, \
    load_cpu_kernels
from minivllm.kernels.greedy_argmax import naive_greedy_argmax
from minivllm.kernels.paged_decode_attention import naive_paged_decode_attention
from minivllm.kernels.rms_norm import naive_rms_norm
from minivllm.kernels.rotary_embedding import naive_rotary_embedding
from minivllm.kernels.silu_and_mul import naive_silu_and_mul
from minivllm.kernels.skinny_gemm import naive_skinny_gemm, pack_skinny_weight
from minivllm.layers.rotary import RopeSpec, RotaryEmbedding



def test_the_isa_levels_their_aliases_and_an_unknown_name(monkeypatch):
    for value, level in [("", "native"), ("native", "native"), ("avx2", "avx2"), ("x86-64-v3", "avx2"),
                         (" X86-64 ", "portable"), ("portable", "portable")]:
        monkeypatch.setenv("MINIVLLM_CPU_ISA", value)
        assert isa_level() == level, value
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match=r"MINIVLLM_CPU_ISA='avx512' is not a level .*'portable'.*'x86-64-v3'"):
        isa_level()


def test_what_each_level_hides_from_minivllms_view_of_the_cpu():
    """avx2: everything above x86-64-v3; portable: everything above baseline x86-64 (SSE2), AVX and FMA too."""
    assert not any(hides_flag(f, "native") for f in ("avx512f", "amx_tile", "avx2"))
    assert [hides_flag(f, "avx2") for f in ("avx512f", "avx512_bf16", "amx_tile", "avx_vnni", "avx2", "fma")] == \
        [True, True, True, True, False, False]
    assert all(hides_flag(f, "portable") for f in ("avx512f", "amx_tile", "avx", "avx2", "fma", "f16c", "sse4_2"))
    assert not any(hides_flag(f, "portable") for f in ("sse", "sse2", "fpu", "lm"))


def test_each_level_builds_into_a_folder_named_after_it():
    """Two levels never overwrite (or load) each other's build: the level leads the name, the digest of the
    level's flags follows it."""
    names = {level: build_name(level) for level in ("native", "avx2", "portable")}
    assert len(set(names.values())) == 3
    for level, name in names.items():
        assert name.startswith(f"minivllm_cpu_kernels_{level}_") and name.endswith(build_key(tuple(cpu_build.ISA_CFLAGS[level])))


def test_a_level_this_cpu_cannot_run_is_not_built(monkeypatch):
    """MINIVLLM_CPU_ISA=avx2 on a CPU without AVX2 would load code that dies on its first instruction."""
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx2")
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: frozenset({"sse", "sse2"}))
    assert build_level() == "native"
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"}))
    assert build_level() == ("avx2" if platform.machine() == "x86_64" else "native")
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "portable")  # any x86-64 runs it
    assert build_level() == ("portable" if platform.machine() == "x86_64" else "native")


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
def test_the_portable_build_passes_the_kernel_tests():
    """MINIVLLM_CPU_ISA=portable builds the plain loops (-march=x86-64, SSE2 only) under a name of its own, and
    the kernel tests run against it in a process of their own: every kernel against its naive reference."""
    env = {**os.environ, "MINIVLLM_CPU_ISA": "portable"}
    probe = ("from minivllm.kernels.cpu_build import load_cpu_kernels; b = load_cpu_kernels(); "
             "assert b.available, b.detail; print(b.detail)")
    built = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0 and "built for ISA level portable (-march=x86-64) as minivllm_cpu_kernels_portable_" \
        in built.stdout, built.stderr[-2000:]
    here = Path(__file__).parent
    files = [str(here / f"test_{name}_kernel.py") for name in ("rms_norm", "rotary_embedding", "silu_and_mul",
                                                               "greedy_argmax", "paged_decode_attention",
                                                               "kv_cache_write_cpu", "skinny_gemm")]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files], env=env,
                           capture_output=True, text=True, timeout=600, cwd=here.parent.parent)
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


# The paths this CPU does not run by default, each built under a library name of its own (and a folder
# named after the sources' digest, so an edited kernel is rebuilt). "portable_fma" is the plain loop on a
# target with a fused multiply-add but no AVX2 (as arm64): the loop's own path, built from skinny_gemm.cpp
# alone, the only kernel whose plain loop has a row-grouping the compiler could treat differently.
VARIANTS = {"avx2": (["-march=x86-64-v3"], {"avx2", "fma"}, cpu_build.SOURCES),
            "avx512_no_bf16": (["-march=x86-64-v4", "-mno-avx512bf16"],
                               {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, cpu_build.SOURCES),
            "portable_fma": (["-march=x86-64-v2", "-mfma"], {"avx", "fma"}, ("skinny_gemm.cpp",))}


def _variant_ops(variant: str):
    cflags, needs, sources = VARIANTS[variant]
    if platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists():
        pytest.skip("x86-64 instruction sets")
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {variant} build")
    library = f"minivllm_cpu_test_{variant}"
    build_cpu_kernels(f"{library}_{build_key(tuple(cflags))}", cflags, library=library, sources=sources)
    return getattr(torch.ops, library)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_skinny_gemm_path_gives_a_row_its_own_bits(variant):
    """Batch invariance needs a row's product to be the same bits alone or beside others: every path sums
    each output as one chain over k, in k's order, whatever the rows per call. The plain loop once left
    its multiply-add to the compiler, which fused it at -march=x86-64-v3 for 2-4 rows and not for one.
    In fp32 the chain is the same on every path, so each equals the build this process runs."""
    ops = _variant_ops(variant)
    native = load_cpu_kernels()
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, 200, generator=g).to(dtype)
        w = (torch.randn(72, 200, generator=g) / 200 ** 0.5).to(dtype)
        packed = pack_skinny_weight(w)
        alone = torch.cat([ops.skinny_gemm(x[i:i + 1], packed, 72, None) for i in range(9)])
        for rows in range(2, 10):  # 1-4 rows share a group; 5-9 end in a group of 1-4
            assert torch.equal(ops.skinny_gemm(x[:rows], packed, 72, None), alone[:rows]), (dtype, rows)
        if dtype == torch.float32 and native.available:
            assert torch.equal(torch.ops.minivllm_cpu.skinny_gemm(x, packed, 72, None), alone)


@pytest.mark.parametrize("variant", ["avx2", "avx512_no_bf16"])
def test_the_other_instruction_set_paths_match_naive_too(variant):
    """This machine runs one path of each kernel (the one -march=native selects); CPUs without AVX-512,
    or without its BF16 dot products, run the others."""
    ops = _variant_ops(variant)
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        for rows, out_f, in_f in [(1, 37, 10), (5, 200, 578), (9, 64, 96)]:
            x = torch.randn(rows, in_f, generator=g).to(dtype)
            w = (torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(dtype)
            bias = torch.randn(out_f, generator=g).to(dtype)
            torch.testing.assert_close(ops.skinny_gemm(x, pack_skinny_weight(w), out_f, bias).float(),
                                       naive_skinny_gemm(x, w, bias).float(), **tol)
        kc, vc = (torch.randn(12, 4, 2, 80, generator=g).to(dtype) for _ in range(2))
        tables = torch.randperm(12, generator=g)[:9].view(3, 3).int()
        q, lens = torch.randn(3, 6, 80, generator=g).to(dtype), torch.tensor([1, 7, 12])
        torch.testing.assert_close(ops.paged_decode_attention(q, kc, vc, tables, lens, 0.1).float(),
                                   naive_paged_decode_attention(q, kc, vc, tables, lens, 0.1).float(), **tol)
        x, res = torch.randn(5, 80, generator=g).to(dtype), torch.randn(5, 80, generator=g).to(dtype)
        w = torch.randn(80, generator=g).to(dtype)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6).float(), naive_rms_norm(x, w, 1e-6).float(), **tol)
        out, h = ops.fused_add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(h, x + res)
        torch.testing.assert_close(out.float(), naive_rms_norm(h, w, 1e-6).float(), **tol)
        # RoPE is exact on every path: no fused multiply-add may creep in where the compiler would add one
        rope = RotaryEmbedding(40, 64, RopeSpec(), torch.device("cpu"))
        qk, positions = torch.randn(6, 3, 40, generator=g).to(dtype), torch.tensor([0, 1, 9, 33, 63, 2])
        assert torch.equal(ops.rotary_embedding(qk, positions, rope.cos, rope.signed_sin),
                           naive_rotary_embedding(qk, positions, rope.cos, rope.signed_sin))
        gate_up = (torch.randn(5, 2 * 72, generator=g) * 4).to(dtype)  # 72: vectors of 16 or 8, then a tail
        torch.testing.assert_close(ops.silu_and_mul(gate_up).float(), naive_silu_and_mul(gate_up).float(), **tol)
        logits = torch.randn(4, 1000, generator=g).to(dtype)
        logits[1, 500], logits[2, 7], logits[2, 900] = float("nan"), 50.0, 50.0  # a NaN wins; a tie: the first
        assert torch.equal(ops.greedy_argmax(logits), naive_greedy_argmax(logits))


@pytest.mark.parametrize("variant", ["avx2", "avx512_no_bf16"])
@pytest.mark.parametrize("D", [32, 64, 128, 40])  # 4, 8, 16 (two slices) registers of 8 lanes; 40: the generic path
def test_decode_attention_on_the_other_paths_matches_naive_and_keeps_rows_apart(variant, D):
    """Each row's result from its own keys alone (alone or beside others: the same bits), near the reference."""
    ops = _variant_ops(variant)
    g = torch.Generator().manual_seed(D)
    for dtype in (torch.float32, torch.bfloat16):
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        kc, vc = (torch.randn(40, 16, 2, D, generator=g).to(dtype) for _ in range(2))
        tables = torch.randperm(40, generator=g)[:36].view(4, 9).int()
        q, lens = torch.randn(4, 6, D, generator=g).to(dtype), torch.tensor([1, 9, 140, 75])
        out = ops.paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
        torch.testing.assert_close(out.float(), naive_paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5).float(),
                                   **tol)
        alone = [ops.paged_decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], lens[i:i + 1], D ** -0.5)
                 for i in range(4)]
        assert torch.equal(torch.cat(alone), out)


def test_silu_on_8_lanes_gives_the_16_lane_bits():
    """exp8 (AVX2) is exp16 (AVX-512) lane for lane: the same polynomial, clamps and rounding, with 2^n built in
    the exponent bits as two factors so that n = 128 (e^88.4 .. e^89, finite) does not overflow to inf. Run
    where this CPU has AVX-512: the native build against the AVX2 one."""
    if not {"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags() or isa_level() != "native":
        pytest.skip("needs the native AVX-512 build beside the AVX2 one")
    ops, native = _variant_ops("avx2"), load_cpu_kernels()
    assert native.available, native.detail
    g = torch.Generator().manual_seed(3)
    gate = torch.cat([torch.randn(4000, generator=g) * 6, torch.linspace(-89.5, -86.5, 2000),  # e^-g at the clamps
                      torch.linspace(86.5, 89.5, 2000), torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0] * 4)])
    x = torch.cat([gate, torch.randn(gate.numel(), generator=g)]).view(1, -1)  # I = 8016: whole vectors only
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ops.silu_and_mul(x.to(dtype)).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           torch.ops.minivllm_cpu.silu_and_mul(x.to(dtype)).view(
                               torch.int16 if dtype == torch.bfloat16 else torch.int32))
