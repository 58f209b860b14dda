"""Qwen3-MoE and Qwen2-MoE (models/qwen3_moe.py) against HF transformers, fp32, on tiny random checkpoints:
teacher-forced logits and greedy generation, both checkpoint layouts and both config generations, the
router and the sort by expert on their own, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import prompt_logits, varied_prompts
from moe_helpers import hf_moe_model, tiny_moe_checkpoint
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.layers.fused_moe import FusedMoE, TorchMoeMethod
from minivllm.layers.moe_router import select_experts, sort_tokens_by_expert
from minivllm.models.hf_config import load_model_spec, parse_model_spec
from minivllm.models.llama import MLP
from minivllm.models.qwen3_moe import SparseMoeBlock
from minivllm.teaching.hf_check import assert_hf_greedy

torch.set_num_threads(1)  # tiny tensors: threads only add overhead on 2 cores
TOL = dict(atol=1e-4, rtol=1e-4)

# (family, checkpoint layout, config keys, config overrides)
CASES = {
    "qwen3-per_expert-t5-renorm": ("qwen3_moe", "per_expert", "transformers5", dict(norm_topk_prob=True)),
    "qwen3-fused-t4-no_renorm": ("qwen3_moe", "fused", "transformers4", dict(norm_topk_prob=False)),
    "qwen2-per_expert-t4-no_renorm": ("qwen2_moe", "per_expert", "transformers4", dict(norm_topk_prob=False)),
    "qwen2-fused-t5-renorm-no_bias": ("qwen2_moe", "fused", "transformers5", dict(norm_topk_prob=True, qkv_bias=False)),
    # layers 0 (mlp_only_layers) and 2 (decoder_sparse_step 2) dense, 1 and 3 sparse
    "qwen3-dense_layers": ("qwen3_moe", "per_expert", "transformers5",
                           dict(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2)),
}


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), warmup=False, dtype="float32", **{"block_size": 4, "num_kv_blocks": 64, **kwargs})


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, layout, keys, overrides = CASES[request.param]
    path = tiny_moe_checkpoint(tmp_path_factory.mktemp(request.param), family, layout=layout, config_keys=keys,
                               **overrides)
    return path, hf_moe_model(path), overrides


def test_teacher_forced_logits_match_hf(case):
    path, hf, overrides = case
    llm = engine(path)
    for ids in ([7], varied_prompts(9, 384, seed=4)[-1]):  # one token, and 70 (every expert is routed to)
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(prompt_logits(llm, ids), expected, **TOL)
    layers = llm.llm_engine.model.model.layers
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in layers]
    assert sparse == ([False, True, False, True] if "mlp_only_layers" in overrides else [True, True])
    assert all(isinstance(layer.mlp, MLP) for layer, s in zip(layers, sparse) if not s)
    experts = layers[1].mlp.experts
    assert llm.llm_engine.model.expert_layers() == [layer.mlp.experts for layer, s in zip(layers, sparse) if s]
    assert experts.renormalize == hf.config.norm_topk_prob
    assert int(experts.last_load.sum()) == 70 * 2 and experts.last_load.shape == (8,)  # the 70-token prompt's routes


def test_greedy_generate_equals_hf_generate(case):
    path, hf, _ = case
    prompts = varied_prompts(9, 384, seed=5)[4:8]  # 5, 8, 9 and 17 tokens
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = engine(path, max_num_batched_tokens=16).generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                            use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                              pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref
        assert_hf_greedy(hf, p, out.outputs[0].token_ids, tol=1e-5)


def test_both_config_generations_give_the_same_spec(tmp_path):
    t5 = load_model_spec(tiny_moe_checkpoint(tmp_path / "t5", "qwen2_moe"))
    t4 = load_model_spec(tiny_moe_checkpoint(tmp_path / "t4", "qwen2_moe", config_keys="transformers4"))
    assert t4 == t5
    assert t5.moe.num_experts == 8 and t5.moe.shared_expert_intermediate_size == 48 and not t5.moe.norm_topk_prob
    assert t5.attention_bias and not t5.qk_norm and not t5.o_proj_bias  # Qwen2's attention
    cfg = json.loads((tmp_path / "t5" / "config.json").read_text())
    q3 = parse_model_spec({**cfg, "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False})
    assert q3.qk_norm and not q3.attention_bias and q3.moe.shared_expert_intermediate_size == 0  # no shared expert


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_is_hfs_router(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3,
                                               norm_topk_prob=renormalize))
    torch.nn.init.normal_(router.weight)
    x = torch.randn(10, 16)
    with torch.no_grad():
        logits, weights, ids = router(x)
    got = select_experts(logits, 3, renormalize)
    assert torch.equal(got.topk_ids, ids) and got.topk_ids.dtype == torch.int64
    torch.testing.assert_close(got.topk_weights, weights, atol=0, rtol=0)
    assert got.topk_weights.dtype == torch.float32
    sums = got.topk_weights.sum(-1)
    assert torch.allclose(sums, torch.ones(10)) == renormalize  # without renormalizing, the k shares sum below 1


def test_sort_tokens_by_expert_the_docstrings_example_and_random_routes():
    routes = sort_tokens_by_expert(torch.tensor([[2, 0], [0, 1], [2, 1]]), num_experts=4)
    assert routes.route_ids.tolist() == [1, 2, 3, 5, 0, 4]
    assert routes.token_ids.tolist() == [0, 1, 1, 2, 0, 2] and routes.expert_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert routes.counts.tolist() == [2, 2, 2, 0] and routes.offsets.tolist() == [0, 2, 4, 6, 6]
    torch.manual_seed(1)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(50)])  # (50, 4): distinct experts per token
    routes = sort_tokens_by_expert(ids, 16)
    for e in range(16):
        rows = routes.token_ids[routes.offsets[e]:routes.offsets[e + 1]]
        assert rows.tolist() == (ids == e).any(-1).nonzero().flatten().tolist()  # its tokens, in order
    assert torch.equal(ids.flatten()[routes.route_ids], routes.expert_ids)
    assert routes.counts.sum() == 200 and torch.equal(routes.counts, torch.bincount(ids.flatten(), minlength=16))


def test_fused_moe_reads_only_the_routed_experts():
    torch.manual_seed(2)
    moe = FusedMoE(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, renormalize=True)
    torch.nn.init.normal_(moe.w13_weight, std=0.3)
    torch.nn.init.normal_(moe.w2_weight, std=0.3)
    x, logits = torch.randn(5, 16), torch.randn(5, 6)
    logits[:, 4] = -1e4  # nobody routes to expert 4 ...
    with torch.no_grad():
        expected = torch.zeros(5, 16)
        weights, ids = select_experts(logits, 2, True)
        for t in range(5):  # the definition, one token and one route at a time
            for j in range(2):
                gate, up = (moe.w13_weight[ids[t, j]] @ x[t]).split(8)
                expected[t] += weights[t, j] * (moe.w2_weight[ids[t, j]] @ (F.silu(gate) * up))
        moe.w13_weight[4] = float("nan")  # ... so its weights are never read
        moe.w2_weight[4] = float("nan")
        out = moe(x, logits)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert moe.last_load[4] == 0 and moe.last_load.sum() == 10


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_moe_method_keeps_naive_fused_moes_contract(dtype, tol):
    """The default method and the kernels' reference (kernels/fused_moe.py): fp32 sums, x's dtype out."""
    from minivllm.kernels.fused_moe import naive_fused_moe

    torch.manual_seed(3)
    moe = FusedMoE(num_experts=8, top_k=3, hidden_size=32, intermediate_size=16, renormalize=False).to(dtype)
    torch.nn.init.normal_(moe.w13_weight, std=0.2)
    torch.nn.init.normal_(moe.w2_weight, std=0.2)
    x = torch.randn(13, 32, dtype=dtype)
    weights, ids = select_experts(torch.randn(13, 8), 3, renormalize=False)
    with torch.no_grad():
        out = TorchMoeMethod().apply(moe, x, weights, ids)
        ref = naive_fused_moe(x, moe.w13_weight, moe.w2_weight, weights, ids)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("bad, words", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(mlp_only_layers=[5]), "mlp_only_layers"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    (dict(num_experts=0), "num_experts=0"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    (dict(use_sliding_window=True), "sliding-window"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_configs_it_cannot_run_are_refused_by_name(bad, words):
    cfg = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=384, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    parse_model_spec(cfg)  # the base is fine
    with pytest.raises(ValueError, match=words):
        parse_model_spec({**cfg, **bad})
    with pytest.raises(ValueError, match="num_local_experts"):
        parse_model_spec({k: v for k, v in cfg.items() if k != "num_experts"})


def test_a_checkpoint_that_disagrees_with_its_config_is_refused(tmp_path):
    path = tiny_moe_checkpoint(tmp_path / "ok", "qwen3_moe")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 16}))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        engine(path)
    (path / "config.json").write_text(json.dumps(cfg))
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]  # one expert's up half missing
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights for .*layers.1.mlp.experts.w13_weight"):
        engine(path)
