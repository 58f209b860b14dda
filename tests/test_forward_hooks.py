"""Forward hooks work on every layer of a model the engine runs (layers are ordinary nn.Modules, issue 42):
the first thing a student tries, hooking a layer to look at its activations, sees the real activations,
and a hook that returns nothing changes nothing."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.cpu.planned_linear import PlannedLinearMethod
from minivllm.layers.linear import Linear
from minivllm.layers.norm import RMSNorm
from minivllm.models import MODEL_REGISTRY
from minivllm.models.llama import MLP, DecoderLayer
from minivllm.teaching.checkpoints import make_tiny_model
from minivllm.teaching.tiny_moe import make_tiny_moe_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
PROMPT = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6]}]


@pytest.mark.parametrize("warmup", [False, True])
def test_forward_hooks_on_the_layers_of_an_engine_model_fire_with_the_activations(model_factory, warmup):
    llm = LLM(model_factory("qwen3"), block_size=4, num_kv_blocks=64, warmup=warmup,
              enable_prefix_caching=False)  # every run computes all 6 prompt rows
    model, spec = llm.llm_engine.model, llm.llm_engine.model.spec
    expected = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    if warmup:  # the CPU plan was attached from outside, and hooks still see the layers
        assert isinstance(model.model.layers[0].mlp.gate_up_proj.quant_method, PlannedLinearMethod)
    layer = model.model.layers[0]
    targets = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj, "mlp": layer.mlp,
               "input_layernorm": layer.input_layernorm, "q_norm": layer.self_attn.q_norm,
               "attention": layer.self_attn, "decoder_layer": layer}
    assert isinstance(targets["qkv_proj"], Linear) and isinstance(targets["q_norm"], RMSNorm)
    assert isinstance(targets["mlp"], MLP) and isinstance(targets["decoder_layer"], DecoderLayer)
    out_shapes, in_shapes = collections.defaultdict(list), collections.defaultdict(list)
    handles = []
    for name, module in targets.items():
        handles.append(module.register_forward_hook(
            lambda m, args, out, name=name: out_shapes[name].append(tuple((out if torch.is_tensor(out) else out[0]).shape))))
        handles.append(module.register_forward_pre_hook(
            lambda m, args, name=name: in_shapes[name].append(tuple(args[1 if name in ("attention", "decoder_layer")
                                                                       else 0].shape))))
    try:
        assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected  # hooks changed nothing
    finally:
        for handle in handles:
            handle.remove()
    H, q_kv = spec.hidden_size, spec.q_size + 2 * spec.kv_size
    # the prefill (6 rows) first, then one row per decode step (3 more steps for 4 tokens)
    assert out_shapes["qkv_proj"] == [(6, q_kv)] + [(1, q_kv)] * 3
    steps = [(6, H)] + [(1, H)] * 3
    assert out_shapes["o_proj"] == out_shapes["mlp"] == out_shapes["attention"] == out_shapes["decoder_layer"] == steps
    assert in_shapes["mlp"] == in_shapes["attention"] == in_shapes["decoder_layer"] == steps
    assert out_shapes["q_norm"] == [(6, spec.num_attention_heads, spec.head_dim)] + [
        (1, spec.num_attention_heads, spec.head_dim)] * 3
    assert in_shapes["input_layernorm"] == [(6, H)] + [(1, H)] * 3


def test_a_hook_that_replaces_an_output_changes_the_tokens(model_factory):
    """The control: the hook runs inside the engine's forward. Zeroing the final norm's output zeroes every
    logit, and greedy argmax then picks token 0 each step."""
    llm = LLM(model_factory("qwen3"), block_size=4, num_kv_blocks=64, warmup=False)
    norm = llm.llm_engine.model.model.norm
    expected = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    assert expected != [0] * 4
    handle = norm.register_forward_hook(lambda m, args, out: (out[0] * 0, out[1]))
    try:
        assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == [0] * 4
    finally:
        handle.remove()
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected


# Every architecture the engine serves, by the tiny family that builds its checkpoint; a ...ForConditionalGeneration
# name is that family's text checkpoint in the multimodal form (text_config, weights under model.language_model).
FAMILY_OF = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "MistralForCausalLM": "mistral", "Qwen3_5ForCausalLM": "qwen3_5", "Gemma3ForCausalLM": "gemma3",
             "Qwen3_5ForConditionalGeneration": "qwen3_5", "Gemma3ForConditionalGeneration": "gemma3",
             "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}


def checkpoint_of(architecture: str, tmp_path_factory) -> str:
    family = FAMILY_OF[architecture]
    folder = tmp_path_factory.mktemp(family)
    path = make_tiny_moe_model(folder, family) if family.endswith("_moe") else make_tiny_model(folder, family)
    if architecture.endswith("ForConditionalGeneration"):
        cfg = json.loads((path / "config.json").read_text())
        text = {k: v for k, v in cfg.items() if k != "architectures"}
        (path / "config.json").write_text(json.dumps({"architectures": [architecture], "text_config": text,
                                                      "eos_token_id": cfg["eos_token_id"]}))
        weights = load_file(str(path / "model.safetensors"))
        save_file({k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
                   for k, v in weights.items()}, str(path / "model.safetensors"))
    assert json.loads((path / "config.json").read_text())["architectures"] == [architecture]
    return str(path)


def test_every_architecture_in_the_registry_has_a_tiny_checkpoint_here():
    assert set(FAMILY_OF) == set(MODEL_REGISTRY)  # a new architecture joins the hook test below


@pytest.mark.parametrize("architecture", sorted(FAMILY_OF))
def test_hooks_on_every_decoder_layer_and_a_linear_fire_in_every_architecture(architecture, tmp_path_factory):
    """Each model calls its decoder layers (and they their sub-layers) as modules, as HF's do, so a hook on
    any of them sees every step; hooks that return nothing leave the tokens as they were."""
    llm = LLM(checkpoint_of(architecture, tmp_path_factory), block_size=4, num_kv_blocks=64, warmup=False,
              dtype="float32", enable_prefix_caching=False)
    model = llm.llm_engine.model
    assert type(model) is MODEL_REGISTRY[architecture]
    expected = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    layers = list(model.model.layers)
    linear = next(m for m in layers[-1].modules() if isinstance(m, Linear))  # the last layer's first projection
    seen = collections.defaultdict(list)
    handles = [module.register_forward_hook(  # Llama's layer returns (its MLP output, the residual stream)
        lambda m, args, out, key=key: seen[key].append(tuple((out if torch.is_tensor(out) else out[0]).shape)))
        for key, module in [*enumerate(layers), ("linear", linear)]]
    try:
        assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected
    finally:
        for handle in handles:
            handle.remove()
    H, rows = model.spec.hidden_size, [6, 1, 1, 1]  # the prefill, then one row per decode step
    for i in range(len(layers)):
        assert seen[i] == [(n, H) for n in rows], (architecture, i)
    assert [shape[0] for shape in seen["linear"]] == rows and seen["linear"][0][1] == linear.out_features
