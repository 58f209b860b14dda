"""kernels/cpu_build.py: the C++ CPU kernels' build, its ISA levels (native, avx2, portable) and their build
folders, its failure reports, the code paths this CPU does not run (built here under other op-library names
and compared with the naive references), and the compile-only check of levels no CI machine may run."""

from __future__ import annotations

import fcntl
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from minivllm.kernels import cpu_build
from minivllm.kernels import compile_check
from minivllm.kernels.compile_check import compile_only, compile_only_sources
from minivllm.kernels.cpu_build import (_cause, build_cpu_kernels, build_key, build_level, build_name, hides_flag,
                                        isa_level, load_cpu_kernels)
from minivllm.kernels.greedy_argmax import naive_greedy_argmax
from minivllm.kernels.paged_decode_attention import naive_paged_decode_attention
from minivllm.kernels.rms_norm import naive_rms_norm
from minivllm.kernels.rotary_embedding import naive_rotary_embedding
from minivllm.kernels.silu_and_mul import naive_silu_and_mul
from minivllm.kernels.skinny_gemm import naive_skinny_gemm, pack_skinny_weight
from minivllm.layers.rotary import RopeSpec, RotaryEmbedding


def test_a_failed_build_reports_the_compiler_error_not_the_command_line():
    text = ("Error building extension 'x': [1/2] c++ -MMD -MF sg.o.d -isystem /very/long/include/path ...\n"
            "FAILED: sg.o\nc++: error: unrecognized command-line option '-mfoo'\nninja: build stopped")
    assert _cause(text) == "c++: error: unrecognized command-line option '-mfoo'"
    assert _cause("something else went wrong\nlast line") == "last line"
    missing = "[1/3] /x/c++ -c a.cpp\n/bin/sh: 1: /x/c++: not found\nninja: build stopped: subcommand failed."
    assert _cause(missing) == "/bin/sh: 1: /x/c++: not found"


def test_the_build_is_loaded_here_or_says_why():
    build = load_cpu_kernels()
    assert build.detail
    if os.environ.get("CI"):
        assert build.available, f"CI must build the CPU kernels: {build.detail}"


def test_the_shared_header_is_part_of_the_build_flags(monkeypatch, tmp_path):
    """torch's builder rebuilds when a .cpp or a flag changes, not a header: the headers' digest is a flag."""
    import hashlib

    import torch.utils.cpp_extension as cpp_extension

    from minivllm.kernels import cpu_build

    seen = {}
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **kw: seen.update(kw, sources=sources))  # no .so
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_cpu_kernels("header_flag_test", ["-O0"], library="header_flag_test")
    header = b"".join((Path(cpu_build.__file__).parent / h).read_bytes() for h in ("cpu_simd.h", "paged_decode_simd.h"))
    assert f"-DMINIVLLM_HEADERS_DIGEST={hashlib.sha256(header).hexdigest()[:12]}" in seen["extra_cflags"]
    assert len(seen["sources"]) == len(cpu_build.SOURCES)


def test_a_build_held_by_another_process_is_waited_for_a_bounded_time(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp_extension

    loads = []

    def load(name, sources, build_directory, **kw):
        loads.append(Path(build_directory).name)
        (Path(build_directory) / f"{name}.so").touch()

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loads.append(f"loaded {Path(path).parent.name}"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    root = tmp_path / "minivllm"
    root.mkdir()
    with open(root / "held.lock", "a+") as held:  # what another process building here holds
        fcntl.flock(held, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"another process has been building .* for more than 0.5 s"):
            build_cpu_kernels("held", [], library="held", wait_s=0.5)
        assert 0.5 <= time.monotonic() - start < 60 and loads == []
    (root / "held.building-1").mkdir()  # the folder of a build that was killed half-way, and its compilers
    build_cpu_kernels("held", [], library="held", wait_s=0.5)
    assert loads == [f"held.building-{os.getpid()}"]  # compiled in a folder of its own, then moved into place
    assert sorted(p.name for p in root.iterdir()) == ["held", "held.lock"] and (root / "held" / "held.so").exists()
    build_cpu_kernels("held", [], library="held", wait_s=0.5)
    # built: the library is loaded where it is, and torch's builder (whose ninja run could rebuild the folder,
    # silently, when it was last built from another checkout's paths) is not called again
    assert loads[-1] == "loaded held" and len(loads) == 2


def test_a_link_planted_as_the_build_lock_is_not_followed(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    root = tmp_path / "minivllm"
    root.mkdir()
    target = tmp_path / "elsewhere" / "planted"
    target.parent.mkdir()
    (root / "linked.lock").symlink_to(target)  # dangling: following it would create the file it names
    with pytest.raises(OSError):
        build_cpu_kernels("linked", [], library="linked", wait_s=0.5)
    assert not target.exists()


def test_the_build_folder_is_keyed_by_the_sources_and_flags(monkeypatch):
    from minivllm.kernels import cpu_build

    key = build_key(("-march=native",))
    assert key == build_key(("-march=native",)) != build_key(("-march=native", "-O0"))
    monkeypatch.setattr(cpu_build, "_digest", lambda files: "other sources")
    assert build_key(("-march=native",)) != key  # another checkout never loads this one's binary


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


def test_compile_only_levels_compile_the_sources_with_code_for_them(monkeypatch, tmp_path):
    """x86-64-v4: every kernel with an AVX-512 path (decode attention's is in its header), not the memcpy;
    amx: the kernels with AMX or avx512_bf16 code. A compiler error is reported with its message."""
    v4 = compile_only_sources("x86-64-v4")
    assert "paged_decode_attention.cpp" in v4 and "rms_norm.cpp" in v4 and "kv_cache_write.cpp" not in v4
    assert "skinny_gemm.cpp" in compile_only_sources("amx")
    monkeypatch.setitem(compile_check.COMPILE_ONLY, "x86-64-v4", (["-mno-such-flag"], ("__AVX512F__",)))
    with pytest.raises(RuntimeError, match=r"do not compile for x86-64-v4: .*\.cpp: .*no-such-flag"):
        compile_only("x86-64-v4", tmp_path)


def test_compile_only_skips_a_level_the_native_build_already_compiles(tmp_path, capsys):
    """`--cannot-run`: on a CPU with AVX-512 the native build compiles the x86-64-v4 code, so CI does not
    compile it twice; on an AVX2 CPU it does (what .ci/run relies on to check code it cannot run)."""
    avx512 = tmp_path / "avx512"
    avx512.write_text("processor : 0\nflags : fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512dq\n")
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor : 0\nflags : fpu sse2 avx2 fma\n")
    assert compile_check.native_build_covers("x86-64-v4", avx512)
    assert not compile_check.native_build_covers("x86-64-v4", avx2) and not compile_check.native_build_covers("amx", avx512)
    assert not compile_check.native_build_covers("amx", tmp_path / "absent")


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


RACE = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from minivllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], block_size=4, num_kv_blocks=64)  # its warm-up loads the kernels
    outs = llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    print([(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outs], flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_processes_that_meet_in_a_fresh_build_folder_take_turns(qwen3_dir, tmp_path):
    """One process is killed half-way through building (its files and torch's lock file stay behind); two
    engines then start together on that folder: one builds, the other waits for it, and every request of
    both ends with its finish reason (a build from other sources, or a wait that never ends, once ended a
    notebook's request after one token, or held a start-up for minutes)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    killed = subprocess.Popen([sys.executable, "-c", "from minivllm.kernels.cpu_build import load_cpu_kernels; "
                               "load_cpu_kernels()"], env=env, stderr=subprocess.PIPE, text=True)
    for line in killed.stderr:  # the compiler is running
        if "compiling" in line:
            break
    time.sleep(3)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    engines = [subprocess.Popen([sys.executable, "-c", RACE, qwen3_dir], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=800) for p in engines]
    for p, (out, err) in zip(engines, results):
        assert p.returncode == 0, err
        assert out.strip().splitlines()[-1] == str([("length", 12)] * 4), err
    said = results[0][1] + results[1][1]
    assert said.count("the CPU kernels are built") == 1 and "waiting for another process" in said


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
