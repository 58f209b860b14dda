"""Checkpoint formats: transformers-4 and -5 config keys, sharded safetensors, dtypes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.models.hf_config import parse_model_spec
from minivllm.teaching.hf_check import assert_hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 33, 80, 120, 7]}, {"prompt_token_ids": list(range(40, 61))}]


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_transformers4_and_5_config_keys_parse_the_same():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64)
    llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    v4 = parse_model_spec({**base, "torch_dtype": "bfloat16", "rope_theta": 5e5,
                           "rope_scaling": {"rope_type": "llama3", **llama3}})
    v5 = parse_model_spec({**base, "dtype": "bfloat16",
                           "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}})
    old_style = parse_model_spec({**base, "torch_dtype": "bfloat16", "rope_theta": 5e5,
                                  "rope_scaling": {"type": "llama3", **llama3}})
    assert v4 == v5 == old_style
    assert v5.rope.rope_type == "llama3" and v5.rope.theta == 5e5 and v5.dtype == "bfloat16"
    with pytest.raises(ValueError, match="RoPE type 'yarn' is not supported"):
        parse_model_spec({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_transformers4_checkpoint_loads_identically(tmp_path, model_factory):
    src = model_factory("llama_mha_tied_llama3")
    old = tmp_path / "v4"
    shutil.copytree(src, old)
    cfg = json.loads((old / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    (old / "config.json").write_text(json.dumps(cfg))
    assert tokens(LLM(str(old), num_kv_blocks=32)) == tokens(LLM(src, num_kv_blocks=32))


def test_sharded_safetensors(tmp_path, model_factory, hf_factory):
    hf = hf_factory("qwen2")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_factory('qwen2')}/{f}", sharded / f)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert tokens(LLM(str(sharded), num_kv_blocks=32)) == tokens(LLM(model_factory("qwen2"), num_kv_blocks=32))


@pytest.mark.parametrize("dtype,tol", [("float16", 0.05), ("bfloat16", 0.25)])
def test_half_precision_dtypes(dtype, tol, model_factory):
    """Half precision on CPU: the weights and the KV cache take the dtype; greedy tokens are HF
    argmaxes within half-precision rounding (HF run in the same dtype)."""
    path = model_factory("qwen3")
    llm = LLM(path, dtype=dtype, num_kv_blocks=32)
    assert llm.llm_engine.model_runner.kv_cache.dtype == getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False)):
        assert_hf_greedy(hf, p["prompt_token_ids"], out.outputs[0].token_ids, tol=tol)
