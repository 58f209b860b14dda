"""dtype "auto": bf16 on CPU only for a 16-bit checkpoint on a CPU that computes bf16 natively, and the
default model's converted checkpoint says which precision its GGUF holds."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from gguf_writer import write_llama_gguf

from minivllm.config import EngineConfig
from minivllm.engine.loading import resolve_dtype
from minivllm.cpu.cpu_info import CpuInfo
from minivllm.models.hf_config import load_model_spec

CPU = torch.device("cpu")
NATIVE = {"amx": CpuInfo("a Xeon with AMX", amx=True, avx512_bf16=True, last_level_cache_bytes=1 << 25),
          "avx512_bf16": CpuInfo("an EPYC", amx=False, avx512_bf16=True, last_level_cache_bytes=1 << 25)}
NOT_NATIVE = CpuInfo("an AVX2 laptop", amx=False, avx512_bf16=False, last_level_cache_bytes=1 << 23)


@pytest.fixture(scope="module")
def spec(qwen3_dir):
    return load_model_spec(qwen3_dir)


def auto(spec, checkpoint_dtype, cpu, device=CPU):
    return resolve_dtype(EngineConfig(model="m"), replace(spec, dtype=checkpoint_dtype), device, cpu)


@pytest.mark.parametrize("cpu", list(NATIVE.values()) + [NOT_NATIVE], ids=[*NATIVE, "no_native_bf16"])
def test_an_fp32_checkpoint_stays_fp32_on_every_cpu(spec, cpu):
    assert auto(spec, "float32", cpu) == torch.float32
    assert auto(spec, None, cpu) == torch.float32  # a config that names no dtype claims nothing


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "torch.bfloat16"])
@pytest.mark.parametrize("cpu", NATIVE.values(), ids=NATIVE.keys())
def test_a_16_bit_checkpoint_runs_bf16_where_the_cpu_computes_it(spec, checkpoint, cpu):
    assert auto(spec, checkpoint, cpu) == torch.bfloat16


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16"])
def test_a_16_bit_checkpoint_runs_fp32_on_a_cpu_without_native_bf16(spec, checkpoint):
    assert auto(spec, checkpoint, NOT_NATIVE) == torch.float32


def test_an_explicit_dtype_and_cuda_are_untouched_by_the_cpu_rule(spec):
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]:
        config = EngineConfig(model="m", dtype=name)
        assert resolve_dtype(config, replace(spec, dtype="bfloat16"), CPU, NOT_NATIVE) == dtype
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
