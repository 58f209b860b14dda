"""`minivllm bench`: engine flags reach the engine, the roofline line says how far from the machine's
peaks a run is, and the single-stream ceiling line's numbers agree with each other."""

from __future__ import annotations

import functools
import re
import types

import pytest
import torch

from minivllm.entrypoints import bench, cli, roofline
from minivllm.entrypoints.roofline import (MatmulWeights, Peaks, ceiling_report, matmul_weights,
                                           measure_read_bandwidth, report)
from minivllm.cpu.cpu_info import CpuInfo

CEILING = re.compile(r"single-stream ceiling on (.+): read ([\d.]+) GB/s / ([\d.]+) MB of matmul weights a token "
                     r"\((.+)\) = ([\d.]+) tok/s; reached ([\d.]+) tok/s = ([\d.]+)% of it")


class Recorded(Exception):
    pass


@pytest.mark.parametrize("single_stream", [False, True])
def test_bench_passes_engine_flags_to_llm(monkeypatch, single_stream):
    seen = []

    def record(*args, **kwargs):
        seen.append(kwargs)
        raise Recorded

    monkeypatch.setattr(bench, "LLM", record)
    argv = ["bench", "--model", "m", "--quantization", "int8", "--dtype", "bfloat16",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    with pytest.raises(Recorded):
        cli.main(argv + (["--single-stream"] if single_stream else []))
    [kwargs] = seen
    assert kwargs["quantization"] == "int8" and kwargs["dtype"] == "bfloat16" and kwargs["device"] == "cpu"
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}


def test_bench_runs_quantized_with_a_roofline(qwen3_dir, capsys):
    result = bench.throughput(qwen3_dir, num_requests=4, hf=False, quantization="int8", num_kv_blocks=64)
    out = capsys.readouterr().out
    assert result["minivllm_tok_s"] > 0 and result["dtype"] == torch.float32
    assert "int8 weights" in out and "roofline: weights streamed" in out and "GFLOP/s" in out


def test_matmul_weights_count_the_decoder_and_the_lm_head_once(qwen3_dir):
    from minivllm import LLM

    llm = LLM(qwen3_dir, num_kv_blocks=8, warmup=False)
    model, spec = llm.llm_engine.model, llm.llm_engine.spec
    weights = matmul_weights(model)
    per_layer = spec.hidden_size * (spec.q_size + 2 * spec.kv_size) + spec.q_size * spec.hidden_size \
        + 3 * spec.hidden_size * spec.intermediate_size
    assert weights.decoder_params == spec.num_hidden_layers * per_layer
    assert weights.lm_head_params == spec.vocab_size * spec.hidden_size
    assert weights.bytes == 4 * (weights.decoder_params + weights.lm_head_params)  # fp32
    line = report(Peaks(20.0, 100.0, torch.float32, 25.0), MatmulWeights(1000, 0, 10 ** 9), seconds=1.0, steps=10,
                  rows_computed=10, rows_sampled=10)
    assert "10.0 GB/s = 50% of the measured copy bandwidth (20.0 GB/s)" in line  # 1 GB a step, 10 steps a second
    assert "40% of the read bandwidth (25.0 GB/s)" in line
    assert "0.0 GFLOP/s" in line


def test_read_bandwidth_is_positive_and_below_any_cpu_memory():
    gb_s = measure_read_bandwidth(64 << 20, repeats=2)
    assert 0 < gb_s < 5000  # a whole socket of HBM reads ~1 TB/s; 64 MiB does not fit any L1/L2


def test_ceiling_is_read_bandwidth_over_weight_bytes():
    """22 GB/s over 270 MB a token (SmolLM2 in bf16 on the issue's Xeon): ~81 tok/s; 33 tok/s is ~40 %."""
    peaks = Peaks(copy_gb_s=30.0, gemm_gflop_s=400.0, dtype=torch.bfloat16, read_gb_s=22.0)
    weights = MatmulWeights(decoder_params=100, lm_head_params=35, bytes=270_000_000)
    cpu = CpuInfo("Some CPU", amx=True, avx512_bf16=True, last_level_cache_bytes=1 << 20)
    line = ceiling_report(cpu, peaks, weights, tok_s=33.0, precision="bfloat16")
    assert line == ("single-stream ceiling on Some CPU: read 22.00 GB/s / 270.00 MB of matmul weights a token "
                    "(bfloat16) = 81.48 tok/s; reached 33.00 tok/s = 40.5% of it")


@pytest.mark.parametrize("engine", [{}, {"dtype": "bfloat16"}, {"dtype": "bfloat16", "quantization": "int8"}],
                         ids=["fp32", "bf16", "int8"])
def test_single_stream_prints_a_consistent_ceiling(qwen3_dir, capsys, monkeypatch, engine):
    # A small GEMM for the FLOP/s peak: the ceiling only needs the read bandwidth, measured as in the bench.
    monkeypatch.setattr(bench, "measure_peaks", functools.partial(roofline.measure_peaks, n=256))
    result = bench.single_stream(qwen3_dir, new_tokens=4, hf=False, repeats=1, num_kv_blocks=16, **engine)
    out = capsys.readouterr().out
    [match] = [m for m in map(CEILING.search, out.splitlines()) if m]
    cpu, gb_s, mb, precision, ceiling, reached, percent = match.groups()
    gb_s, mb, ceiling, reached, percent = map(float, (gb_s, mb, ceiling, reached, percent))
    assert cpu == CpuInfo.read().model_name
    assert ("int8 weights" in precision) == ("quantization" in engine)
    assert precision.startswith("float32" if not engine else "bfloat16")
    # tok/s = GB/s / bytes, to the printed digits (each of GB/s and MB is rounded to 0.005)
    assert ceiling == pytest.approx(gb_s * 1e3 / mb, rel=0.005 / gb_s + 0.005 / mb + 0.005 / ceiling)
    assert ceiling == pytest.approx(result["ceiling_tok_s"], abs=0.005)
    assert reached == pytest.approx(result["minivllm_tok_s"], abs=0.005)
    assert percent == pytest.approx(100 * result["ceiling_fraction"], abs=0.05)
    assert 0 < gb_s < 5000



def _vs_vllm():
    """benchmarks/vs_vllm.py, imported by path (benchmarks/ is a folder of scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "vs_vllm.py"
    spec = importlib.util.spec_from_file_location("vs_vllm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_vllm"] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_vs_vllm_table_gives_medians_beside_the_best_and_dashes_for_systems_not_run():
    vs = _vs_vllm()
    [fp32, _compiled, *single] = vs.plan("tiny", "smol", ["float32"], list(vs.SINGLE_STREAM_VARIANTS), requests=4)
    assert len(single) == 4 and len({row.hf for row in single}) == 1  # one HF run shared by four rows
    # the options that shorten a session: eager throughput only, the chosen single-stream settings
    [eager, default] = vs.plan("tiny", "smol", ["float32"], ["defaults"], requests=4, compiled_throughput=False)
    assert eager.minivllm.engine == () and "defaults" in default.label
    results = vs.Results()
    for hf, mini in ((10.0, 30.0), (20.0, 20.0), (15.0, 60.0)):  # three rounds; a busy one for minivllm
        results.add(fp32.hf, hf)
        results.add(fp32.minivllm, mini)
    line = vs.table([fp32], results).splitlines()[2]
    assert "4 requests, 30M Qwen3, float32" in line
    # medians 15 and 30 (2.00x), bests 20 and 60 (3.00x); vLLM was not run
    assert line.endswith("| 15.0 tok/s (20.0) | — | 30.0 (60.0) | — (—) | 2.00× (3.00×) |")


def test_a_capped_level_is_named_on_every_line_and_handed_to_vllm(monkeypatch):
    """The ISA level goes with every benchmark figure; at a capped level a missing library cap is named, and
    vLLM's driver is told the CPU has no AVX-512, so it loads its AVX2 library as on an AVX2 laptop."""
    from minivllm.entrypoints.bench_peers import LIBRARY_CAPS, level_line, vllm_prelude

    monkeypatch.delenv("MINIVLLM_CPU_ISA", raising=False)
    assert level_line() == "ISA level native" and vllm_prelude() == ""
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "x86-64-v3")
    for name in LIBRARY_CAPS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    assert "NOT SET" in level_line() and "ONEDNN_MAX_CPU_ISA=AVX2" in level_line()
    for name, value in LIBRARY_CAPS["avx2"].items():
        monkeypatch.setenv(name, value)
    assert level_line().startswith("ISA level avx2 (capped") and "NOT SET" not in level_line()
    fake_torch_cpu = types.SimpleNamespace(_is_avx512_supported=lambda: True, _is_amx_tile_supported=lambda: True)
    exec(vllm_prelude().replace("import torch", ""), {"torch": types.SimpleNamespace(cpu=fake_torch_cpu)})
    assert not fake_torch_cpu._is_avx512_supported() and not fake_torch_cpu._is_amx_tile_supported()
