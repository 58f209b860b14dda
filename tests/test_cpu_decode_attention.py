"""The PyTorch attention backend's decode rows through minivllm's C++ kernel (reading the paged cache in
place) instead of gather + SDPA, and greedy sampling through its argmax kernel: each chosen by measurement
at warm-up, and the engine's tokens match HF's whichever way they run."""

from __future__ import annotations

import pytest
import torch
from helpers import varied_prompts

from minivllm import LLM, SamplingParams
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.layers.sampler import GREEDY_CANDIDATES, Sampler
from minivllm.layers.torch_attention import DECODE_CANDIDATES, TorchAttentionBackend
from minivllm.cpu.decode_kernels import choose_decode_kernel
from minivllm.cpu.tuner import forced
from minivllm.teaching.hf_check import assert_hf_greedy

needs_kernels = pytest.mark.skipif(not load_cpu_kernels().available, reason=load_cpu_kernels().detail)


@needs_kernels
@pytest.mark.parametrize("used", [True, False])
@pytest.mark.parametrize("family", ["qwen3", "llama_mha_tied_llama3"])
def test_engine_tokens_match_hf_with_and_without_the_kernel(family, used, model_factory, hf_factory):
    """Decode batches of 1-9 rows of unequal contexts, beside prefill chunks (max_num_batched_tokens)."""
    llm = LLM(model_factory(family), block_size=4, num_kv_blocks=128, max_num_batched_tokens=32)
    backend = llm.llm_engine.model_runner.backend
    assert isinstance(backend, TorchAttentionBackend)
    backend.decode_kernel = forced(DECODE_CANDIDATES, DECODE_CANDIDATES[used], "forced by the test")
    sampler = llm.llm_engine.model_runner.sampler
    sampler.greedy_kernel = forced(GREEDY_CANDIDATES, GREEDY_CANDIDATES[used], "forced by the test")
    prompts = varied_prompts(9, llm.llm_engine.spec.vocab_size, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    hf = hf_factory(family)
    for p, out in zip(prompts, outs):
        assert_hf_greedy(hf, p, out.outputs[0].token_ids)
    llm.shutdown()


@needs_kernels
def test_warm_up_measures_the_kernel_and_says_what_it_chose(model_factory):
    llm = LLM(model_factory("qwen3"), block_size=4, num_kv_blocks=64)
    choice = llm.llm_engine.model_runner.backend.decode_kernel
    assert "measured" in choice.detail() and "rows" in choice.detail(choice.probes)
    assert str(choice).startswith("decode attention and K/V writes: ")
    greedy = llm.llm_engine.model_runner.sampler.greedy_kernel
    assert "measured" in greedy.detail() and "rows x 384" in str(greedy)
    assert str(greedy).startswith("greedy sampling: ")
    llm.shutdown()


def test_without_warm_up_or_for_fp16_the_backend_keeps_gather_and_sdpa():
    backend = TorchAttentionBackend(4, 2, 16)
    assert not backend.decode_kernel.used and "not measured" in str(backend.decode_kernel)
    assert not choose_decode_kernel(backend, torch.float16, block_size=4).used and not backend.decode_kernel.used


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_sampling_kernel_matches_argmax_rows(dtype):
    """All-greedy rows: the kernel over the model's dtype picks argmax_rows' tokens over float32."""
    from minivllm.layers.sampler import SamplingRow, SamplingTensors, argmax_rows

    logits = torch.randn(9, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[3, [10, 500]] = 9.0  # a tie: the first
    t = SamplingTensors.from_params([SamplingRow(0.0, 0, 1.0, 0.0, 0, 5)] * 9, 1000, torch.device("cpu"))
    sampler = Sampler()
    sampler.greedy_kernel = forced(GREEDY_CANDIDATES, "kernel", "forced by the test")
    assert sampler(logits, t).tolist() == argmax_rows(logits.float()).tolist()
    assert sampler(logits, t)[3] == 10
    # rows whose values are strided, as the LM head's (W x^T)^T form returns them (a CI run chose it)
    strided = torch.stack([logits, logits], dim=-1)[..., 0]  # (9, 1000), stride (2000, 2)
    assert strided.stride(1) == 2 and sampler(strided, t).tolist() == argmax_rows(logits.float()).tolist()
