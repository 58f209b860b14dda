"""The engine on the Triton backend (interpreter on CPU) checked against HF, and the `kernels` quirk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.teaching.hf_check import assert_hf_greedy

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def triton_llm(model_factory):
    return LLM(model_factory("qwen3"), attention_backend="triton", block_size=16, num_kv_blocks=32,
               max_num_batched_tokens=64)


def test_greedy_matches_hf_with_chunks_prefix_hits_and_split_kv(triton_llm, hf_factory, monkeypatch):
    from minivllm.kernels import grouped_decode_attention as gd

    calls = {"split": 0}
    original = gd.grouped_decode_attention

    def counting(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, *args):
        calls["split"] += num_splits > 1
        return original(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, *args)

    monkeypatch.setattr(gd, "grouped_decode_attention", counting)
    monkeypatch.setattr(gd, "MIN_KEYS_PER_SPLIT", 32)  # split these short contexts too (GPU: >= 128 keys a split)
    long_prompt = varied_prompts(9, 384, seed=11)[-1] * 2  # 140 tokens: chunked, then split-KV decodes
    # a short request decodes while the long one prefills (mixed steps); the third hits the cache
    prompts = [[3, 4, 5], long_prompt, long_prompt[:40] + [7, 8, 9]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = triton_llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert_hf_greedy(hf_factory("qwen3"), p, o.outputs[0].token_ids)
    assert outs[2].num_cached_tokens == 32
    assert calls["split"] > 0
    assert triton_llm.get_stats().num_mixed_steps > 0


def test_triton_sampler_seed_is_independent_of_companions(triton_llm):
    target = {"prompt_token_ids": [5, 6, 7, 8]}
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=5, max_tokens=4, ignore_eos=True)
    alone = triton_llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=0.7, seed=1, max_tokens=3, ignore_eos=True)
    crowded = triton_llm.generate([{"prompt_token_ids": [9, 10]}, target], [other, sp], use_tqdm=False)
    assert crowded[1].outputs[0].token_ids == alone


def test_triton_backend_refuses_small_blocks(qwen3_dir):
    with pytest.raises(ValueError, match="power of two >= 16"):
        LLM(qwen3_dir, attention_backend="triton", block_size=8)


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(qwen3_dir):
    if "cuda" in run_python("import torch; print('cuda' if torch.cuda.is_available() else '')").stdout:
        pytest.skip("a GPU is present")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from minivllm import LLM; LLM({qwen3_dir!r}, attention_backend='triton')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr


def test_transformers_never_sees_a_kernels_hub():
    """Run from the repository root, where `kernels/` is importable as a top-level folder."""
    r = run_python(
        "import minivllm.kernels.paged_attention, importlib.util\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print(importlib.util.find_spec('kernels') is not None, is_kernels_available())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "False"
    code = "import importlib.util; print(importlib.util.find_spec('kernels'))"
    installed = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert installed.stdout.strip() == "None", "minivllm must not install a top-level `kernels` package"


def test_kernel_benchmark_says_it_needs_cuda_on_cpu():
    if "cuda" in run_python("import torch; print('cuda' if torch.cuda.is_available() else '')").stdout:
        pytest.skip("a GPU is present: the benchmark would run for real")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_bench.py")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "needs a CUDA GPU" in r.stdout


def test_sampling_outputs_work_on_the_triton_backend(triton_llm, model_factory):
    """Logprobs, penalties, biases, bad words and n > 1 are not torch-only features."""
    torch_llm = LLM(model_factory("qwen3"), block_size=16, num_kv_blocks=32, warmup=False)
    prompt = {"prompt_token_ids": [9, 10, 11, 12]}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, repetition_penalty=1.5,
                            presence_penalty=0.5, logit_bias={42: 3.0}, n=2)
    a = triton_llm.generate(prompt, greedy, use_tqdm=False)[0]
    b = torch_llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert len(a.outputs) == 2 and a.outputs[0].token_ids == a.outputs[1].token_ids  # greedy children agree
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-3 for t in x)
    sampled = triton_llm.generate(prompt, SamplingParams(temperature=1.0, seed=4, max_tokens=4, n=3,
                                                         allowed_token_ids=[50, 51, 52], ignore_eos=True),
                                  use_tqdm=False)[0]
    assert all(set(c.token_ids) <= {50, 51, 52} for c in sampled.outputs)
