"""What minivllm reads of the CPU (cpu/cpu_info.py) and that no matmul form is tried where the CPU
cannot run it: oneDNN's bf16 reorder (the PACKED form) raises on a CPU without AVX-512 BW+VL+DQ or
AVX-NE-CONVERT, so `LLM(dtype="bfloat16")` once failed to start on every AVX2-only CPU. The no-AVX-512
path is forced two ways: an injected `CpuInfo` (with the op made to raise as torch does there), and a
real start under the ISA cap (MINIVLLM_CPU_ISA=avx2 with torch's and oneDNN's own caps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minivllm.cpu.cpu_info import CpuInfo, onednn_runs_bf16
from minivllm.cpu.planned_linear import planned_linear
from minivllm.cpu.matmul_forms import MatmulForm, can_pack
from minivllm.cpu.attach import attached_plan
from minivllm.cpu.matmul_plan import ROW_BUCKETS, MatmulPlan
from minivllm.cpu.tuning_cache import TuningCache
from minivllm.teaching.checkpoints import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
AVX2_LAPTOP = CpuInfo("an AVX2 laptop", amx=False, avx512_bf16=False, last_level_cache_bytes=1 << 23)
CAPPED = {"MINIVLLM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

# /proc/cpuinfo flags of a few CPUs (the part that matters here)
ZEN3 = frozenset({"avx", "avx2", "fma", "f16c"})
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}  # AVX-512, no avx512_bf16
ARROW_LAKE = ZEN3 | {"avx_vnni", "avx_vnni_int8", "avx_ne_convert"}  # no AVX-512, bf16 converts in AVX2


def test_onednn_bf16_is_torchs_guard_over_the_flags_not_native_bf16():
    assert not onednn_runs_bf16(ZEN3, "x86_64", "")
    assert onednn_runs_bf16(SKYLAKE_SP, "x86_64", "")  # runs oneDNN's bf16 path, though not natively
    assert not onednn_runs_bf16(SKYLAKE_SP - {"avx512dq"}, "x86_64", "")  # each of BW, VL, DQ is needed
    assert onednn_runs_bf16(ARROW_LAKE, "x86_64", "")
    assert not onednn_runs_bf16(ARROW_LAKE - {"avx_ne_convert"}, "x86_64", "")
    # oneDNN's own cap: AVX2 allows neither level, AVX512_CORE only the AVX-512 one
    assert not onednn_runs_bf16(SKYLAKE_SP | ARROW_LAKE, "x86_64", "AVX2")
    assert onednn_runs_bf16(SKYLAKE_SP, "x86_64", "avx512_core_bf16")
    assert not onednn_runs_bf16(ARROW_LAKE, "x86_64", "AVX512_CORE")
    assert onednn_runs_bf16(ARROW_LAKE, "x86_64", "AVX2_VNNI_2") and onednn_runs_bf16(ARROW_LAKE, "x86_64", "ALL")
    assert onednn_runs_bf16(frozenset({"fp", "asimd", "bf16"}), "aarch64", "")
    assert not onednn_runs_bf16(frozenset({"fp", "asimd"}), "aarch64", "")
    # not native_bf16's set: Skylake-SP runs oneDNN's bf16 in software, the dtype rule keeps it in fp32
    skylake = CpuInfo("Skylake-SP", amx=False, avx512_bf16=False, last_level_cache_bytes=1 << 25, onednn_bf16=True)
    assert skylake.onednn_bf16 and not skylake.native_bf16


def test_the_isa_cap_hides_every_avx512_and_amx_answer(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx2")
    capped = CpuInfo.read()
    assert not (capped.amx or capped.avx512_bf16 or capped.native_bf16 or capped.vnni or capped.onednn_bf16)
    assert "oneDNN bf16: no" in str(capped)
    # AVX2 + FMA + F16C stay visible under the avx2 cap (where the CPU has them), and are hidden at portable
    has_v3 = {"avx2", "fma", "f16c"} <= _proc_flags()
    assert capped.x86_64_v3 == has_v3 and f"AVX2+FMA: {'yes' if has_v3 else 'no'}" in str(capped)
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "portable")
    assert not CpuInfo.read().x86_64_v3 and "AVX2+FMA: no" in str(CpuInfo.read())
    monkeypatch.delenv("MINIVLLM_CPU_ISA")
    assert CpuInfo.read().model_name == capped.model_name


def _proc_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.split(":")[0].strip() in ("flags", "Features"):
            return set(line.partition(":")[2].split())
    return set()


PROBE = ("import json, torch\nfrom minivllm.cpu.cpu_info import CpuInfo\n"
         "print(json.dumps([CpuInfo.read().onednn_bf16, torch.ops.mkldnn._is_mkldnn_bf16_supported()]))")


@pytest.mark.parametrize("onednn_cap", ["", "AVX2", "AVX512_CORE"])
def test_onednn_bf16_agrees_with_torch_on_this_cpu(onednn_cap):
    """torch answers its own guard (`_is_mkldnn_bf16_supported`): the flags must give the same answer here,
    under each of oneDNN's caps (read once per process, hence a process each)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ONEDNN_MAX_CPU_ISA": onednn_cap}
    env.pop("MINIVLLM_CPU_ISA", None)
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours, torchs = json.loads(done.stdout.strip().splitlines()[-1])
    assert ours == torchs


@pytest.fixture
def reorders(monkeypatch) -> list[torch.dtype]:
    """oneDNN's weight reorder (the PACKED form's copy, without which it cannot run) as on a CPU without
    AVX-512 BW+VL+DQ or AVX-NE-CONVERT: it raises for bf16 with torch's message, runs for fp32; each
    call's dtype is recorded."""
    calls, reorder = [], torch.ops.mkldnn._reorder_linear_weight

    def refuse_bf16(w: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(w.dtype)
        if w.dtype is torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert "
                               "or avx512bw, avx512vl and avx512dq")
        return reorder(w, *args, **kwargs)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse_bf16)
    return calls


def test_a_cpu_without_onednn_bf16_never_packs_bf16(reorders):
    assert not can_pack(torch.empty(4, 4, dtype=torch.bfloat16), AVX2_LAPTOP)
    assert can_pack(torch.empty(4, 4), AVX2_LAPTOP) == torch.backends.mkldnn.is_available()
    for dtype in (torch.bfloat16, torch.float32):
        weights = [torch.randn(96, 64).to(dtype) for _ in range(4)]
        plan = MatmulPlan()
        plan.measure(weights, repeats=1, cache_bytes=0, cpu=AVX2_LAPTOP)  # time even these tiny weights
        packs = can_pack(weights[0], AVX2_LAPTOP)  # without a packed form, no prefill contest: F.linear there
        assert plan.source == "measured" and len(plan.forms) == len(ROW_BUCKETS) - (not packs)
        if dtype is torch.bfloat16:
            assert MatmulForm.PACKED not in plan.forms.values() and getattr(weights[0], "packed", None) is None
        x = torch.randn(3, 64).to(dtype)
        torch.testing.assert_close(planned_linear(x, weights[0], None, plan).float(), (x @ weights[0].t()).float(),
                                   rtol=2e-2, atol=2e-2)
    # fp32 was packed (the op was reachable), bf16 never was
    assert torch.bfloat16 not in reorders and (torch.float32 in reorders) == torch.backends.mkldnn.is_available()


def test_a_cached_packed_bf16_choice_is_measured_again_on_a_cpu_that_cannot_run_it(reorders):
    """The tuning cache's file is keyed by the CPU's name and flags, not by oneDNN's cap: a PACKED choice
    timed where oneDNN took bf16 can meet a process where it cannot. It is measured again, not replayed."""
    weights = [torch.randn(96, 64, dtype=torch.bfloat16) for _ in range(4)]
    MatmulPlan().measure(weights, repeats=1, cache_bytes=0, cpu=AVX2_LAPTOP)
    path = TuningCache().path
    data = json.loads(path.read_text())
    [(entry, decided)] = [(k, v) for k, v in data["entries"].items() if k.startswith("matmul")]
    for choice in decided.values():  # as a CPU with oneDNN's bf16 path would have saved it
        choice["speedups"][MatmulForm.PACKED.value] = 2.0
        choice["chosen"] = MatmulForm.PACKED.value
    path.write_text(json.dumps(data))
    plan = MatmulPlan()
    plan.measure(weights, repeats=1, cache_bytes=0, cpu=AVX2_LAPTOP)
    assert plan.source == "measured" and MatmulForm.PACKED not in plan.forms.values()
    assert not reorders
    rewritten = json.loads(path.read_text())["entries"][entry]
    assert all(MatmulForm.PACKED.value not in choice["speedups"] for choice in rewritten.values())


START = textwrap.dedent("""
    import sys
    from minivllm import LLM, SamplingParams
    from minivllm.cpu.attach import attached_plan
    from minivllm.cpu.cpu_info import CpuInfo
    from minivllm.cpu.matmul_forms import MatmulForm
    assert not CpuInfo.read().onednn_bf16, CpuInfo.read()
    llm = LLM(sys.argv[1], dtype="bfloat16", block_size=4, num_kv_blocks=64)
    plan = attached_plan(llm.llm_engine.model.lm_head_layer)
    assert plan.source == "measured", plan.summary()  # the timing pass (where the reorder was called) ran
    assert MatmulForm.PACKED not in plan.forms.values(), plan.summary()
    out = llm.generate([{"prompt_token_ids": [5, 9, 2, 7]}], SamplingParams(temperature=0, max_tokens=6,
                       ignore_eos=True), use_tqdm=False)[0]
    print(out.outputs[0].finish_reason, len(out.outputs[0].token_ids))
""")


def test_a_bfloat16_engine_starts_and_generates_under_the_avx2_cap(tmp_path):
    """A real start where torch refuses oneDNN's bf16 path (ONEDNN_MAX_CPU_ISA=AVX2 makes any x86 CPU one),
    with minivllm and ATen capped alike. The model is just large enough for its ~7 MiB of bf16 weights to
    be timed (above any core's L2), which is where the start used to fail."""
    model = make_tiny_model(tmp_path / "model", hidden_size=256, intermediate_size=2048, num_kv_heads=2)
    script = tmp_path / "start.py"
    script.write_text(START)
    env = {**os.environ, **CAPPED, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script), str(model)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "length 6"
