"""CpuMoeMethod (minivllm/cpu/moe_method.py): attached to every FusedMoE at warm-up, its experts packed in place
of the checkpoint's layout (not beside it), the same answer as the default TorchMoeMethod, and in the engine's
model against HF's."""

from __future__ import annotations

import pytest
import torch
from helpers import prompt_logits, varied_prompts
from moe_helpers import hf_moe_model, tiny_moe_checkpoint

from minivllm import LLM, SamplingParams
from minivllm.cpu.attach import describe
from minivllm.cpu.moe_method import CpuMoeMethod, attach_moe_method
from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.kernels.fused_moe import naive_fused_moe
from minivllm.layers.fused_moe import FusedMoE, TorchMoeMethod
from minivllm.layers.moe_router import select_experts

if not load_cpu_kernels().available:
    pytest.skip(f"minivllm's CPU kernels are not built here: {load_cpu_kernels().detail}", allow_module_level=True)

torch.set_num_threads(1)


def random_layer(dtype: torch.dtype, E: int = 8, k: int = 2, H: int = 64, I: int = 48, seed: int = 0) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    layer = FusedMoE(E, k, H, I, renormalize=True)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5)
        layer.w2_weight.copy_(torch.randn(E, H, I, generator=g) / I ** 0.5)
    return layer.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_experts_replace_the_checkpoints_layout_and_compute_the_same(dtype):
    layer = random_layer(dtype)
    w13, w2 = layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()
    x, logits = torch.randn(5, 64).to(dtype), torch.randn(5, 8)
    with torch.inference_mode():
        expected = layer(x, logits)  # TorchMoeMethod
        said = attach_moe_method(torch.nn.Sequential(layer))
        assert isinstance(layer.moe_method, CpuMoeMethod) and "1 layers" in said, said
        # in place of, not beside: the layer holds the packed tensors only, the same count of weights
        assert layer.w13_weight.dim() == (3 if dtype == torch.float32 else 4) + 1
        assert layer.w13_weight.numel() == w13.numel() and layer.w2_weight.numel() == w2.numel()
        assert [n for n, _ in layer.named_parameters()] == ["w13_weight", "w2_weight"]
        got = layer(x, logits)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, expected, **tol)
        topk_weights, topk_ids = select_experts(logits, 2, True)
        torch.testing.assert_close(got, naive_fused_moe(x, w13, w2, topk_weights, topk_ids), **tol)
        packed = layer.w13_weight
        assert "MoE experts" in attach_moe_method(torch.nn.Sequential(layer))  # a second attach packs nothing
        assert layer.w13_weight is packed


def test_what_cannot_be_packed_keeps_the_torch_method_and_says_why():
    layer = random_layer(torch.float16)
    said = attach_moe_method(torch.nn.Sequential(layer))
    assert isinstance(layer.moe_method, TorchMoeMethod) and "torch.float16" in said and "F.linear" in said
    assert attach_moe_method(torch.nn.Linear(2, 2)) is None  # no experts: nothing to say


def test_the_engines_moe_model_with_the_cpu_method_matches_hf(tmp_path):
    """The engine's tiny Qwen3-MoE, its experts attached as warm-up attaches them, teacher-forced against HF: a
    decode-sized prompt (skinny_gemm) and one of 70 tokens (some experts over 16 rows: the laid-back weights)."""
    path = tiny_moe_checkpoint(tmp_path, "qwen3_moe")
    hf = hf_moe_model(path)
    llm = LLM(str(path), warmup=False, dtype="float32", block_size=4, num_kv_blocks=64)
    model = llm.llm_engine.model
    assert "2 layers" in attach_moe_method(model)
    assert describe(model, model.lm_head_layer)[-1] == "MoE experts: CpuMoeMethod() on 2 layers"
    for ids in ([7], varied_prompts(9, 384, seed=4)[-1]):
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(prompt_logits(llm, ids), expected, atol=1e-4, rtol=1e-4)


def test_warm_up_attaches_it_and_greedy_decoding_equals_hfs(tmp_path):
    """The engine's own warm-up (engine/worker/warmup.py -> cpu/attach.py) gives every FusedMoE the method; a
    decode of 12 tokens (skinny_gemm at one row) gives HF generate's tokens."""
    path = tiny_moe_checkpoint(tmp_path, "qwen3_moe")
    hf = hf_moe_model(path)
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=64)  # warm-up on (the default)
    layers = [m for m in llm.llm_engine.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2 and all(isinstance(m.moe_method, CpuMoeMethod) for m in layers)
    prompt = list(range(5, 22))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out[0].outputs[0].token_ids == ref
