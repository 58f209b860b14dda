"""GGUF checkpoints: a Llama written the way llama.cpp writes it reads back as the same model."""

from __future__ import annotations

import pytest
import torch
from gguf_writer import write_llama_gguf

from helpers import prompt_logits

from minivllm import LLM




@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_and_safetensors_give_the_same_logits(tmp_path, cache, model_factory):
    src = model_factory("llama")
    gguf_file = write_llama_gguf(src, tmp_path / "tiny-llama.gguf")
    from_st, from_gguf = LLM(src, num_kv_blocks=16), LLM(str(gguf_file), num_kv_blocks=16)
    ids = [5, 9, 77, 200, 31, 8, 150, 3, 42]
    torch.testing.assert_close(prompt_logits(from_gguf, ids), prompt_logits(from_st, ids), rtol=0, atol=1e-5)
    assert from_gguf.get_tokenizer()("Hello world").input_ids == from_st.get_tokenizer()("Hello world").input_ids
    converted = list((cache / "models").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    # Converted once: a second load reuses the folder.
    mtime = (converted[0] / "model.safetensors").stat().st_mtime_ns
    LLM(str(gguf_file), num_kv_blocks=16)
    assert (converted[0] / "model.safetensors").stat().st_mtime_ns == mtime


def test_missing_gguf_file_is_a_clear_error(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope.gguf"))


def test_hub_id_offline_gives_a_clear_message(monkeypatch):
    from minivllm.model_source import ModelUnavailableError, resolve_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailableError, match="HF_HUB_OFFLINE=1"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
