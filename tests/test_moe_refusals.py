"""What a mixture of experts must never do silently (review r1's findings): sync the host to count the load,
leave the experts out of the bench's numbers, quantize the router, give another family's eager reason, load
a checkpoint that names an expert past num_experts, writes a place twice or leaves one out, or read a
config.json that lacks a field or names the expert count twice, differently."""

from __future__ import annotations

import json

import pytest
import torch
from moe_helpers import tiny_moe_checkpoint
from safetensors.torch import load_file, save_file

from minivllm import LLM
from minivllm.entrypoints.roofline import matmul_weights
from minivllm.layers.fused_moe import FusedMoE, count_experts
from minivllm.layers.linear import Linear, UnquantizedLinearMethod
from minivllm.layers.moe_router import select_experts, sort_tokens_by_expert
from minivllm.layers.quantization import Int8LinearMethod
from minivllm.models.hf_config import parse_model_spec
from minivllm.models.qwen3_moe import Qwen3MoeForCausalLM
from minivllm.teaching import moe_viz
from minivllm.teaching.tiny_moe import qwen3_30b_a3b_spec

torch.set_num_threads(1)
E, K, H, I = 8, 2, 64, 32  # tiny_moe_checkpoint's sizes, 2 sparse layers


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), warmup=False, dtype="float32", **{"block_size": 4, "num_kv_blocks": 64, **kwargs})


def rewrite(path, mutate) -> None:
    weights = load_file(path / "model.safetensors")
    mutate(weights)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_the_expert_load_is_counted_without_bincount(monkeypatch):
    """torch.bincount reads the ids' min and max back to the host on CUDA: two syncs a sparse layer a step."""
    layer = FusedMoE(E, K, H, I, renormalize=True)
    torch.nn.init.normal_(layer.w13_weight), torch.nn.init.normal_(layer.w2_weight)
    x, logits = torch.randn(5, H), torch.randn(5, E)
    ids = select_experts(logits, K, True).topk_ids
    expected = torch.tensor([int((ids == e).sum()) for e in range(E)])

    def no_bincount(*args, **kwargs):
        raise AssertionError("torch.bincount syncs the host on CUDA")

    monkeypatch.setattr(torch, "bincount", no_bincount)
    with torch.no_grad():
        layer(x, logits)
    assert torch.equal(layer.last_load, expected) and layer.last_load.dtype == torch.int64
    assert torch.equal(sort_tokens_by_expert(ids, E).counts, expected)


def test_the_roofline_counts_k_experts_a_token_and_every_expert_in_the_params():
    """Qwen3-30B-A3B on the meta device: 30.5 B weights, 3.3 B a token (the model card; the embedding table
    is no matmul weight), the same experts decode_bytes counts."""
    spec = qwen3_30b_a3b_spec()
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(spec)
    weights, experts = matmul_weights(model), count_experts(model)
    embedding = spec.vocab_size * spec.hidden_size
    assert round((weights.total_params + embedding) / 1e9, 1) == 30.5
    assert 3.3e9 <= weights.decoder_params + weights.lm_head_params + embedding < 3.4e9
    assert weights.bytes == 4 * (weights.decoder_params + weights.lm_head_params)  # fp32, k experts a layer
    assert weights.idle_expert_params == 48 * (128 - 8) * 3 * 2048 * 768
    assert moe_viz.decode_bytes(spec, 1).expert == experts.expert_params == 3 * 2048 * 768


def test_int8_keeps_the_routers_and_the_experts_in_float_and_says_so(tmp_path, capsys):
    if torch.backends.quantized.engine == "none":
        pytest.skip("this torch build has no int8 CPU kernels")
    llm = engine(tiny_moe_checkpoint(tmp_path, "qwen2_moe"), quantization="int8")
    for layer in llm.llm_engine.model.model.layers:
        mlp = layer.mlp
        assert isinstance(mlp.gate.quant_method, UnquantizedLinearMethod), "the router is quantized"
        assert isinstance(mlp.shared_expert_gate.quant_method, UnquantizedLinearMethod)
        assert isinstance(mlp.shared_expert.gate_up_proj.quant_method, Int8LinearMethod)  # a dense MLP: int8
        assert mlp.experts.w13_weight.dtype == torch.float32
    assert "the experts of 2 sparse layers and 4 routers stay float32" in capsys.readouterr().err
    llm.shutdown()


def test_an_moe_model_gives_its_own_eager_reason(tmp_path):
    llm = engine(tiny_moe_checkpoint(tmp_path), enforce_eager=False)
    assert "does not compile or graph-capture MoE models" in llm.llm_engine.compilation
    assert "linear-attention" not in llm.llm_engine.compilation
    llm.shutdown()


def test_an_expert_past_num_experts_is_refused_by_name(tmp_path):
    path = tiny_moe_checkpoint(tmp_path)
    rewrite(path, lambda w: w.__setitem__("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(I, H)))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.8.up_proj.weight: expert 8 .*num_experts=8"):
        engine(path)


def test_a_tensor_written_twice_is_refused_even_where_it_hides_a_missing_one(tmp_path):
    """Two shards without an index: expert 0's up_proj in both, expert 3's nowhere (counting elements
    filled saw a full parameter)."""
    path = tiny_moe_checkpoint(tmp_path)
    weights = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    again = "model.layers.1.mlp.experts.0.up_proj.weight"
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, str(path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({again: weights[again]}, str(path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{again} writes .*w13_weight where {again} already did"):
        engine(path)


def test_a_layer_stored_both_fused_and_per_expert_is_refused(tmp_path):
    path = tiny_moe_checkpoint(tmp_path)
    fused = load_file(tiny_moe_checkpoint(tmp_path / "fused", layout="fused") / "model.safetensors")
    rewrite(path, lambda w: w.update({k: v for k, v in fused.items() if k.startswith("model.layers.1.mlp.experts.")}))
    with pytest.raises(ValueError, match=r"layers.1.mlp.experts.* already did"):
        engine(path)


def test_a_missing_expert_is_named_with_its_projection(tmp_path):
    path = tiny_moe_checkpoint(tmp_path)
    rewrite(path, lambda w: [w.pop(f"model.layers.1.mlp.experts.{k}") for k in ("3.up_proj.weight",
                                                                                 "5.down_proj.weight")])
    with pytest.raises(ValueError, match=r"w13_weight \(expert 3's up_proj\), .*w2_weight \(expert 5's down_proj\)"):
        engine(path)


CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=384, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("field", ["num_experts_per_tok", "moe_intermediate_size"])
def test_a_config_without_a_moe_field_is_refused_naming_it(field):
    parse_model_spec(CONFIG)  # the base is fine
    with pytest.raises(ValueError, match=f"config.json lacks {field}"):
        parse_model_spec({k: v for k, v in CONFIG.items() if k != field})


def test_two_expert_counts_that_disagree_are_refused(tmp_path):
    assert parse_model_spec({**CONFIG, "num_local_experts": 8}).moe.num_experts == 8  # both, the same: fine
    with pytest.raises(ValueError, match="num_experts=4 and num_local_experts=8"):
        parse_model_spec({**CONFIG, "num_experts": 4, "num_local_experts": 8})
    path = tiny_moe_checkpoint(tmp_path)  # a checkpoint's config.json: refused before any weight is read
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_experts": 4}))
    with pytest.raises(ValueError, match="num_local_experts=8"):
        engine(path)


def test_count_experts_is_none_for_a_dense_model():
    assert count_experts(torch.nn.Sequential(Linear(4, 4))) is None
