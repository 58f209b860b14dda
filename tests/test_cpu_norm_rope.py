"""RMSNorm and RoPE through minivllm's C++ kernels (kernels/rms_norm.py, kernels/rotary_embedding.py) instead
of torch's ops: chosen by measurement at warm-up, never inside a compiled graph, and the engine's tokens
match HF's whichever way they run."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import varied_prompts
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.layers.norm import RMSNorm
from minivllm.cpu.norm_rope_kernels import NormRopeKernels
from minivllm.layers.activation import silu_and_mul
from minivllm.teaching.hf_check import assert_hf_greedy

needs_kernels = pytest.mark.skipif(not load_cpu_kernels().available, reason=load_cpu_kernels().detail)


def force(llm: LLM, used: bool) -> None:
    kernels = llm.llm_engine.model.model.norm.kernels
    kernels.used, kernels.detail = used, "forced by the test"


@needs_kernels
@pytest.mark.parametrize("used", [True, False])
@pytest.mark.parametrize("family", ["qwen3", "llama_mha_tied_llama3"])  # per-head q/k norms; q and k rotated together
def test_engine_tokens_match_hf_with_and_without_the_kernels(family, used, model_factory, hf_factory):
    llm = LLM(model_factory(family), block_size=4, num_kv_blocks=128, max_num_batched_tokens=32)
    force(llm, used)
    prompts = varied_prompts(6, llm.llm_engine.spec.vocab_size, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    hf = hf_factory(family)
    for p, out in zip(prompts, outs):
        assert_hf_greedy(hf, p, out.outputs[0].token_ids)
    llm.shutdown()


@needs_kernels
def test_bfloat16_tokens_match_hf_in_bfloat16_with_the_kernels(model_factory):
    path = model_factory("qwen3")
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64)
    force(llm, True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = varied_prompts(4, llm.llm_engine.spec.vocab_size, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert_hf_greedy(hf, p, out.outputs[0].token_ids, tol=0.25)  # as tests/test_checkpoints.py
    llm.shutdown()


@needs_kernels
def test_warm_up_measures_the_kernels_and_says_what_it_chose(model_factory):
    llm = LLM(model_factory("qwen3"), num_kv_blocks=32)
    choice = llm.llm_engine.model.model.norm.kernels
    assert "measured" in choice.detail and "32 rows" in choice.detail and "1 rows" in choice.detail
    assert str(choice).startswith("RMSNorm, RoPE and silu·mul: ")
    llm.shutdown()


def test_without_warm_up_or_for_fp16_torch_ops_run():
    kernels = NormRopeKernels()
    assert not kernels.used and "not measured" in kernels.detail
    assert not kernels.choose(64, 4, 2, 16, torch.float16).used
    assert "float16" in kernels.detail


# Inductor compiles its C++ for the CPU at hand while ATEN_CPU_CAPABILITY=avx2 picks AVX2 vector code: under that
# emulation (CI's second pass) torch 2.13's compiled residual + F.rms_norm gives garbage with no minivllm code in it
# at all. A real AVX2 CPU has no such mismatch; the emulation does not cover compiled graphs (docs/concepts/kernels.md).
@pytest.mark.skipif(bool(os.environ.get("ATEN_CPU_CAPABILITY")), reason="Inductor under an emulated ATen ISA level")
@needs_kernels
def test_a_compiled_graph_traces_torch_ops_not_the_kernels():
    """Inductor fuses the element-wise ops itself; the kernels have no shape-only (fake) version to trace."""
    kernels = NormRopeKernels(True, "forced by the test")
    norm = RMSNorm(32, 1e-6)
    norm.kernels = kernels
    x, res = torch.randn(4, 32), torch.randn(4, 32)
    with torch.inference_mode():
        eager = norm(x, residual=res)
        compiled = torch.compile(lambda a, b: norm(a, residual=b), fullgraph=True, dynamic=False)(x, res)
    torch.testing.assert_close(compiled, eager)


@needs_kernels
def test_inputs_the_kernel_does_not_take_run_torch_ops_instead():
    """Another dtype for the weight or the residual, a 4-D x, or autograd: the torch path, never an error."""
    kernels = NormRopeKernels(True, "forced by the test")
    norm = RMSNorm(8, 1e-6)  # an fp32 weight
    norm.kernels = kernels
    x = torch.randn(2, 3, 4, 8)
    with torch.inference_mode():
        assert torch.equal(norm(x), norm.forward_native(x))  # 4-D
        xb = x[0].bfloat16()
        assert torch.equal(norm(xb), norm.forward_native(xb))  # bf16 x, fp32 weight
        normed, h = norm(x[0], residual=x[1].bfloat16())  # a residual in another dtype
        assert h.dtype == torch.float32 and torch.equal(normed, norm.forward_native(h))
    y = norm(x[0])  # grad enabled: autograd needs torch's ops
    y.sum().backward()
    assert norm.weight.grad is not None


def test_the_mlp_runs_the_kernel_only_where_it_was_chosen(monkeypatch):
    x = torch.randn(4, 32)
    calls = []
    monkeypatch.setattr("minivllm.layers.activation.silu_and_mul_kernel", lambda t: calls.append(t) or t[:, :16])
    with torch.inference_mode():
        silu_and_mul(x, NormRopeKernels(False, "not chosen"))
        silu_and_mul(x.half(), NormRopeKernels(True, "chosen"))  # fp16: torch's ops
        assert not calls
        silu_and_mul(x, NormRopeKernels(True, "chosen"))
    assert len(calls) == 1
