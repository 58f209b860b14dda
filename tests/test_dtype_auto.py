"""dtype "auto": bf16 on CPU for a 16-bit checkpoint on every x86-64-v3 CPU where minivllm's kernels are
built (they read bf16 weights fast) and on every CPU that computes bf16 natively, fp32 elsewhere; the
default model's converted checkpoint says which precision its GGUF holds; and an explicit bfloat16 or
float32 starts and generates at the capped AVX2 level (where oneDNN takes no bf16) and natively."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf_writer import write_llama_gguf

from minivllm.config import EngineConfig
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.engine.worker.loading import resolve_dtype
from minivllm.models.hf_config import load_model_spec

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent
NATIVE = {"amx": CpuInfo("a Xeon with AMX", amx=True, avx512_bf16=True, last_level_cache_bytes=1 << 25),
          "avx512_bf16": CpuInfo("an EPYC", amx=False, avx512_bf16=True, last_level_cache_bytes=1 << 25)}
AVX2 = CpuInfo("an AVX2 laptop (Zen 3)", amx=False, avx512_bf16=False, last_level_cache_bytes=1 << 23, x86_64_v3=True)
NOT_NATIVE = CpuInfo("an SSE-only x86-64 (or MINIVLLM_CPU_ISA=portable)", amx=False, avx512_bf16=False,
                     last_level_cache_bytes=1 << 23)
# all four caps: minivllm's, ATen's, oneDNN's and MKL's (an AVX-512 machine run as an AVX2 laptop)
CAPPED = {"MINIVLLM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
          "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.fixture(scope="module")
def spec(qwen3_dir):
    return load_model_spec(qwen3_dir)


def auto(spec, checkpoint_dtype, cpu, device=CPU, kernels_built=True):
    return resolve_dtype(EngineConfig(model="m"), replace(spec, dtype=checkpoint_dtype), device, cpu, kernels_built)


@pytest.mark.parametrize("cpu", [*NATIVE.values(), AVX2, NOT_NATIVE], ids=[*NATIVE, "avx2", "no_avx2"])
def test_an_fp32_checkpoint_stays_fp32_on_every_cpu(spec, cpu):
    assert auto(spec, "float32", cpu) == torch.float32
    assert auto(spec, None, cpu) == torch.float32  # a config that names no dtype claims nothing


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "torch.bfloat16"])
@pytest.mark.parametrize("cpu", NATIVE.values(), ids=NATIVE.keys())
def test_a_16_bit_checkpoint_runs_bf16_where_the_cpu_computes_it(spec, checkpoint, cpu):
    assert auto(spec, checkpoint, cpu) == torch.bfloat16


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16"])
def test_a_16_bit_checkpoint_runs_bf16_on_every_avx2_cpu_with_the_kernels_built(spec, checkpoint):
    """No hardware bf16 (Zen 3): the skinny kernel widens bf16 weights in registers, so bf16 streams half
    the bytes; without the kernels, or without AVX2 + FMA (their 8-lane path), nothing reads bf16 fast."""
    assert auto(spec, checkpoint, AVX2) == torch.bfloat16
    assert auto(spec, checkpoint, AVX2, kernels_built=False) == torch.float32
    assert auto(spec, checkpoint, NOT_NATIVE) == torch.float32
    assert auto(spec, checkpoint, NATIVE["avx512_bf16"], kernels_built=False) == torch.bfloat16  # hardware bf16


def test_the_isa_level_decides_what_the_rule_sees(spec, monkeypatch):
    """MINIVLLM_CPU_ISA=portable hides AVX2 and FMA from CpuInfo, so auto is fp32 there on any machine;
    avx2 keeps them (on a CPU that has them, as every x86-64-v3 one does)."""
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "portable")
    assert not CpuInfo.read().x86_64_v3 and auto(spec, "bfloat16", CpuInfo.read()) == torch.float32
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx2")
    capped = CpuInfo.read()
    assert not capped.native_bf16 and "AVX2+FMA: " in str(capped)
    assert auto(spec, "bfloat16", capped) == (torch.bfloat16 if capped.x86_64_v3 else torch.float32)


def test_an_explicit_dtype_and_cuda_are_untouched_by_the_cpu_rule(spec):
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]:
        config = EngineConfig(model="m", dtype=name)
        assert resolve_dtype(config, replace(spec, dtype="bfloat16"), CPU, NOT_NATIVE) == dtype
        assert resolve_dtype(config, replace(spec, dtype="bfloat16"), CPU, AVX2) == dtype
        assert resolve_dtype(config, replace(spec, dtype="float32"), CPU, NATIVE["amx"]) == dtype
    cuda = torch.device("cuda")  # the checkpoint's own dtype, whatever the CPU
    assert auto(spec, "float16", NOT_NATIVE, cuda) == torch.float16
    assert auto(spec, None, NOT_NATIVE, cuda) == torch.bfloat16


def test_the_engine_says_the_dtype_once_and_prints_it_when_the_machine_chose(qwen3_dir, capsys, caplog):
    """The checkpoint's own dtype is only logged; quantization (or a dtype "auto" picked on this CPU
    other than the checkpoint's) is printed on stderr, once."""
    import logging

    from minivllm import LLM

    with caplog.at_level(logging.INFO, logger="minivllm"):
        LLM(qwen3_dir, num_kv_blocks=8, warmup=False)
    assert not [line for line in capsys.readouterr().err.splitlines() if "dtype" in line]
    assert [r.getMessage() for r in caplog.records if "dtype" in r.getMessage()] == [
        "minivllm: dtype float32 (dtype='auto', checkpoint float32, cpu), quantization None"]
    LLM(qwen3_dir, num_kv_blocks=8, warmup=False, quantization="int8")
    lines = [line for line in capsys.readouterr().err.splitlines() if "dtype" in line]
    assert lines == ["minivllm: dtype float32 (dtype='auto', checkpoint float32, cpu), quantization int8"]


def test_a_converted_gguf_records_the_precision_it_holds(tmp_path, monkeypatch, model_factory):
    """An F32 GGUF stays float32 (so the tiny GGUF test stays exact); a quantized one says bfloat16."""
    import gguf

    from minivllm.models.gguf import convert_gguf, source_dtype

    f32 = write_llama_gguf(model_factory("llama"), tmp_path / "tiny.gguf")
    assert source_dtype(f32) == "float32"
    folder = convert_gguf(f32, tmp_path / "cache", verbose=False)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"

    class QuantizedFileType:  # what GGUFReader reports for a Q4_1 file such as the default model's
        def __init__(self, path):
            self.fields = {"general.file_type": type("F", (), {"contents": lambda self: 3})()}

    monkeypatch.setattr(gguf, "GGUFReader", QuantizedFileType)
    assert gguf.LlamaFileType(3) == gguf.LlamaFileType.MOSTLY_Q4_1
    assert source_dtype(f32) == "bfloat16"


START = textwrap.dedent("""
    import json, sys
    from minivllm import LLM, SamplingParams
    from minivllm.cpu.attach import attached_plan
    from minivllm.cpu.cpu_info import CpuInfo
    from minivllm.kernels.cpu_build import load_cpu_kernels
    prompt = {"prompt_token_ids": [5, 9, 2, 7, 11, 3]}
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = []
    for dtype, tuning in [("auto", "cached"), ("bfloat16", "cached"), ("bfloat16", "off"), ("float32", "cached"),
                          ("float32", "off")]:
        llm = LLM(sys.argv[1], dtype=dtype, tuning=tuning, block_size=4, num_kv_blocks=64)
        engine = llm.llm_engine
        plan = attached_plan(engine.model.lm_head_layer)
        weight = engine.model.lm_head_weight
        out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
        runs.append(dict(dtype=dtype, tuning=tuning, resolved=str(engine.dtype), source=plan.source,
                         prefill_form=plan.form_for(weight, 600).name, one_row_form=plan.form_for(weight, 1).name,
                         finish=out.finish_reason, tokens=list(out.token_ids)))
        llm.shutdown()
    cpu = CpuInfo.read()
    print(json.dumps(dict(onednn_bf16=cpu.onednn_bf16, native_bf16=cpu.native_bf16, x86_64_v3=cpu.x86_64_v3,
                          kernels=load_cpu_kernels().available, runs=runs)))
""")


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    """A tiny 16-bit checkpoint whose ~7 MiB of bf16 weights are above any core's L2, so the plan is timed."""
    from transformers import AutoModelForCausalLM

    from minivllm.teaching.checkpoints import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("bf16"), hidden_size=256, intermediate_size=2048, num_kv_heads=2)
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)  # config: bfloat16
    return path


@pytest.mark.parametrize("capped", [True, False], ids=["capped_avx2", "native"])
def test_every_dtype_starts_and_generates_at_every_isa_level(bf16_checkpoint, capped):
    """bfloat16, float32 and auto with tuning cached and off, in a fresh process with all four ISA caps
    (torch's bf16 GEMM without oneDNN: the products of 5+ rows widen to fp32 there) and without them.
    fp32 is HF's greedy text; bf16 is HF's within bf16's error (an argmax within 2^-5 of the logit scale)."""
    from transformers import AutoModelForCausalLM

    script = bf16_checkpoint.parent / "start.py"
    script.write_text(START)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in CAPPED:
        env.pop(name, None)
    env.update(CAPPED if capped else {})
    done = subprocess.run([sys.executable, str(script), str(bf16_checkpoint)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    reads_bf16 = report["native_bf16"] or (report["x86_64_v3"] and report["kernels"])
    hf = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32).eval()
    for run in report["runs"]:
        asked = {"auto": "bfloat16" if reads_bf16 else "float32"}.get(run["dtype"], run["dtype"])
        expected = f"torch.{asked}"
        assert run["resolved"] == expected and run["finish"] == "length", run
        assert run["source"] in (("tuning off",) if run["tuning"] == "off" else ("measured", "cached")), run
        widened = run["resolved"] == "torch.bfloat16" and not report["onednn_bf16"]
        assert run["prefill_form"] == ("WIDENED" if widened else "LINEAR"), run  # the LM head: untimed there
        assert run["tuning"] == "cached" or run["one_row_form"] == "LINEAR", run  # the default at 1-4 rows
        with torch.no_grad():
            ids = [5, 9, 2, 7, 11, 3] + run["tokens"]
            logits = hf(torch.tensor([ids])).logits[0, 5:-1].float()  # (6, V): the rows predicting each token
        rows = torch.arange(len(run["tokens"]))
        gap = logits.max(-1).values - logits[rows, torch.tensor(run["tokens"])]
        tol = 1e-3 if run["resolved"] == "torch.float32" else 2 ** -5 * logits.abs().max(-1).values
        assert (gap <= tol).all(), (run, gap)
    if capped:
        assert not report["onednn_bf16"] and not report["native_bf16"]
