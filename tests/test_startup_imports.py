"""Start-up stays light: what `import minivllm; LLM(...)` must not pull in. Each of these was seconds of every
start on 2 cores when something imported it by the way (benchmarks/startup.py measures the whole start):
torch's compiler stack (llguidance.torch compiles a kernel at import), sympy (torch's meta reference ops, via
`Module.to_empty`), transformers' model-loading stack (AutoTokenizer's AutoConfig: torch.distributed.tensor)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.tensor")


def _imported_after(code: str) -> set[str]:
    probe = textwrap.dedent(code) + f"\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(eval(done.stdout.strip().splitlines()[-1]))


def test_import_minivllm_pulls_in_no_compiler_and_no_sympy():
    assert _imported_after("import minivllm") == set()


def test_an_engine_starts_without_them_once_its_tokenizer_class_is_remembered(qwen3_dir):
    # The first start asks AutoTokenizer (which imports the config stack) and remembers the class; a second
    # process, as every later start, loads the class directly.
    start = f"import minivllm\nminivllm.LLM({qwen3_dir!r}, block_size=4, num_kv_blocks=32)"
    _imported_after(start)
    assert _imported_after(start) == set()


def test_a_start_runs_one_garbage_collection_and_restores_the_collector(qwen3_dir):
    # A start allocates ~1e5 long-lived objects: with automatic collection on, each allocation burst set off
    # collections that walked the whole heap (two full ones in a default-model start). Paused, there is one:
    # the engine's own, before it freezes the heap.
    import gc

    import minivllm

    generations: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(record)
    try:
        llm = minivllm.LLM(qwen3_dir, block_size=4, num_kv_blocks=32)
    finally:
        gc.callbacks.remove(record)
    assert generations == [2]
    assert gc.isenabled()
    llm.shutdown()
    gc.disable()  # a caller that turned the collector off keeps it off, a failed start too
    try:
        minivllm.LLM(qwen3_dir, block_size=4, num_kv_blocks=32, warmup=False).shutdown()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(FileNotFoundError):
        minivllm.LLM(qwen3_dir + "-missing")
    assert gc.isenabled()


def test_import_minivllm_sets_off_no_full_collection_and_leaves_the_collector_on():
    probe = textwrap.dedent("""
        import gc
        full = []
        gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else 0)
        import minivllm
        print(len(full), gc.isenabled())
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["0", "True"]  # with the collector on during the imports: 3 here


def test_the_heap_stays_frozen_through_the_interpreter_exit(qwen3_dir):
    # Unfrozen at exit, the heap was walked by each collection of the interpreter's teardown: ~0.7 s of CPU
    # added to the end of every script (measured after a default-model start). The handler registered first
    # runs last, after weakref's own exit handler (which runs the engine's finalizers marked `atexit`).
    probe = textwrap.dedent(f"""
        import atexit, gc
        atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
        import minivllm
        llm = minivllm.LLM({qwen3_dir!r}, block_size=4, num_kv_blocks=32)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "frozen at exit: True"
