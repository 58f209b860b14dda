"""Shared fixtures: tiny random checkpoints of each family, built once per session, offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run in its interpreter, which must be chosen before any kernel is
# defined (i.e. before minivllm.kernels is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.cpu import tuner  # noqa: E402
from minivllm.teaching.checkpoints import make_tiny_model  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# name -> make_tiny_model kwargs: every family, GQA and MHA, tied and untied, llama3 RoPE scaling.
MODEL_VARIANTS = {
    "qwen3": dict(family="qwen3"),
    "qwen2": dict(family="qwen2"),
    "llama": dict(family="llama"),
    "llama_biased": dict(family="llama", attention_bias=True, mlp_bias=True),  # bias on q/k/v/o and the MLP
    "qwen3_biased": dict(family="qwen3", attention_bias=True),
    "mistral": dict(family="mistral"),  # MistralForCausalLM without a window: the Llama decoder
    "llama_mha_tied_llama3": dict(family="llama", num_kv_heads=4, tie_word_embeddings=True,
                                  rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64}),
}


@pytest.fixture(autouse=True)
def own_tuning_cache(tmp_path_factory, monkeypatch):
    """Each test its own tuning cache (cpu/tuning_cache.py), inherited by the processes it starts: a
    choice timed (or forced) by one test never decides another's kernels, whatever the order, and the
    user's cache is never written by a test."""
    monkeypatch.setenv("MINIVLLM_TUNING_CACHE", str(tmp_path_factory.mktemp("tuning")))


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    @functools.cache
    def make(name: str) -> str:
        return str(make_tiny_model(tmp_path_factory.mktemp(name), **MODEL_VARIANTS[name]))

    return make


@pytest.fixture(scope="session")
def qwen3_dir(model_factory) -> str:
    return model_factory("qwen3")


@pytest.fixture(scope="session")
def hf_factory(model_factory):
    """The HF transformers model for a variant, fp32, eval mode (cached)."""
    from transformers import AutoModelForCausalLM

    @functools.cache
    def load(name: str):
        return AutoModelForCausalLM.from_pretrained(model_factory(name), dtype=torch.float32).eval()

    return load


@pytest.fixture
def timings(monkeypatch) -> list[tuple[str, ...]]:
    """Every call of the tuner's timing function, by candidates; the timings themselves still run."""
    calls, real = [], tuner.time_candidates

    def counted(candidates, probes, repeats=5):
        calls.append(tuple(candidates))
        return real(candidates, probes, repeats)

    monkeypatch.setattr(tuner, "time_candidates", counted)
    return calls
