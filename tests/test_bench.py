"""`minivllm bench`: engine flags reach the engine, and the roofline line says how far from the machine's
peaks a run is."""

from __future__ import annotations

import pytest
import torch

from minivllm.entrypoints import bench, cli
from minivllm.entrypoints.roofline import MatmulWeights, Peaks, matmul_weights, report


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
    line = report(Peaks(20.0, 100.0, torch.float32), MatmulWeights(1000, 0, 10 ** 9), seconds=1.0, steps=10,
                  rows_computed=10, rows_sampled=10)
    assert "10.0 GB/s = 50% of the measured copy bandwidth (20.0 GB/s)" in line  # 1 GB a step, 10 steps a second
    assert "0.0 GFLOP/s" in line
