"""kernels/cpu_build.py: the C++ CPU kernels' build: its failure reports, the headers in its key, the lock
that makes processes take turns on one build folder, the folder's key, and the compile-only check of levels no
CI machine may run. The ISA levels and the code paths this CPU does not run: test_isa_levels.py."""

from __future__ import annotations

import fcntl
import os
import re
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
from minivllm.kernels.cpu_build import _cause, build_cpu_kernels, build_key, load_cpu_kernels



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
    header = b"".join((Path(cpu_build.__file__).parent / h).read_bytes() for h in cpu_build.HEADERS)
    assert f"-DMINIVLLM_HEADERS_DIGEST={hashlib.sha256(header).hexdigest()[:12]}" in seen["extra_cflags"]
    assert len(seen["sources"]) == len(cpu_build.SOURCES)


def test_every_header_a_source_reaches_is_in_the_key_and_included_directly():
    """A header missing from HEADERS is in no digest (editing it would not rebuild), and compile_check's scan
    for a level's macros reads only the headers a source includes itself: so every header a source reaches
    through others (paged_decode_attention.cpp -> paged_decode_avx512.h -> paged_decode_simd.h) is listed,
    and included by the source directly."""
    here = Path(cpu_build.__file__).parent

    def includes(name: str) -> set[str]:
        return set(re.findall(r'#include "([^"]+)"', (here / name).read_text()))
    for source in cpu_build.SOURCES:
        direct = includes(source)
        reached, todo = set(direct), list(direct)
        while todo:
            new = includes(todo.pop()) - reached
            reached |= new
            todo += new
        assert reached <= set(cpu_build.HEADERS) and reached == direct, (source, direct, reached)
    assert {"paged_decode_avx512.h", "paged_decode_avx2.h"} <= includes("paged_decode_attention.cpp")


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
