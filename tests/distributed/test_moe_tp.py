"""Tensor parallelism with experts: each rank a slice of every expert's width (and of the shared expert's),
the router replicated, one all-reduce per MoE block. Without processes: each rank's shard re-cut by hand
from the checkpoint (both layouts) and the ranks' partial sums adding up to one rank's output; with gloo:
2 ranks generate exactly what 1 does."""

from __future__ import annotations

import glob

import pytest
import torch
from moe_helpers import tiny_moe_checkpoint
from safetensors.torch import load_file

from minivllm import LLM, SamplingParams
from minivllm.distributed.parallel_state import ParallelContext
from minivllm.engine.worker.loading import build_model
from minivllm.models.hf_config import load_model_spec, parse_model_spec
from minivllm.models.sharding import check_shardable

PROMPTS = [[5, 17, 33, 80, 120, 7], list(range(40, 61)), [3], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=16, ignore_eos=True) for s in range(4)]
ENGINE = dict(block_size=4, num_kv_blocks=64)


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory) -> str:
    return str(tiny_moe_checkpoint(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe"))


def moe_shard_summary(rank: int, runner) -> dict:
    """What this rank holds of layer 0's MoE block (run on every rank by `collective_rpc`)."""
    mlp = runner.model.model.layers[0].mlp
    shared = mlp.shared_expert
    experts = mlp.experts  # its sizes, not its weights' shapes: warm-up may pack them (cpu/moe_method.py)
    return dict(rank=rank, experts=(experts.num_experts, experts.hidden_size, experts.intermediate_size),
                gate=tuple(mlp.gate.weight.shape), shared=tuple(shared.gate_up_proj.weight.shape) if shared else None)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_each_rank_holds_its_slice_of_every_expert_and_the_partial_sums_add_up(tmp_path, layout):
    torch.manual_seed(0)
    path = tiny_moe_checkpoint(tmp_path, "qwen2_moe", layout=layout)
    spec = load_model_spec(path)
    full = {k: v for f in glob.glob(f"{path}/*.safetensors") for k, v in load_file(f).items()}
    if layout == "fused":  # the per-expert tensors, cut from the fused ones
        for name in [n for n in full if n.endswith("experts.gate_up_proj")]:
            prefix = name.removesuffix("gate_up_proj")  # ...mlp.experts.
            gate_up, down = full.pop(name), full.pop(prefix + "down_proj")
            for e in range(spec.moe.num_experts):
                full[f"{prefix}{e}.gate_proj.weight"], full[f"{prefix}{e}.up_proj.weight"] = gate_up[e].chunk(2)
                full[f"{prefix}{e}.down_proj.weight"] = down[e]
    def layer0_moe(tp: ParallelContext):
        return build_model(spec, path, torch.device("cpu"), torch.float32, 64, tp).model.layers[0].mlp

    one = layer0_moe(ParallelContext())
    x = torch.randn(7, spec.hidden_size)
    with torch.no_grad():
        expected = one(x)
    total = torch.zeros_like(x)
    I, S = spec.moe.moe_intermediate_size // 2, spec.moe.shared_expert_intermediate_size // 2
    for rank in range(2):
        block = layer0_moe(ParallelContext(rank, 2))
        rows = slice(rank * I, (rank + 1) * I)
        p = "model.layers.0.mlp."
        for e in range(spec.moe.num_experts):
            gate, up, down = (full[f"{p}experts.{e}.{w}_proj.weight"] for w in ("gate", "up", "down"))
            assert torch.equal(block.experts.w13_weight[e], torch.cat([gate[rows], up[rows]])), (rank, e)
            assert torch.equal(block.experts.w2_weight[e], down[:, rows]), (rank, e)
        shared = slice(rank * S, (rank + 1) * S)
        gate_up = torch.cat([full[p + "shared_expert.gate_proj.weight"][shared],
                             full[p + "shared_expert.up_proj.weight"][shared]])
        assert torch.equal(block.shared_expert.gate_up_proj.weight, gate_up)
        assert torch.equal(block.shared_expert.down_proj.weight, full[p + "shared_expert.down_proj.weight"][:, shared])
        assert torch.equal(block.gate.weight, full[p + "gate.weight"])  # replicated: every rank routes alike
        assert torch.equal(block.shared_expert_gate.weight, full[p + "shared_expert_gate.weight"])
        with torch.no_grad():  # what this rank adds to the block's all-reduce
            partial = block.experts(x, block.gate(x))
            total += partial + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_refusals_name_the_width_that_does_not_divide():
    base = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=384, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    check_shardable(parse_model_spec(base), 2)
    with pytest.raises(ValueError, match=r"expert width \(moe_intermediate_size\)"):
        check_shardable(parse_model_spec({**base, "moe_intermediate_size": 33}), 2)
    with pytest.raises(ValueError, match=r"shared expert width \(shared_expert_intermediate_size\)"):
        check_shardable(parse_model_spec({**base, "shared_expert_intermediate_size": 47}), 2)
    # intermediate_size is the dense MLP's: it must divide only where some layer keeps a dense MLP
    check_shardable(parse_model_spec({**base, "intermediate_size": 95}), 2)
    with pytest.raises(ValueError, match=r"MLP width \(intermediate_size\)"):
        check_shardable(parse_model_spec({**base, "intermediate_size": 95, "mlp_only_layers": [1]}), 2)


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_two_ranks_generate_what_one_does(qwen2_moe_dir, one_thread_per_rank):
    """Greedy and seeded samples identical to TP=1 on Qwen2-MoE (experts, a shared expert, q/k/v bias);
    each rank holds half of every expert's width and the whole router."""
    def generate(llm: LLM, params) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [c.token_ids for o in outs for c in o.outputs]

    one = LLM(qwen2_moe_dir, warmup=False, **ENGINE)
    greedy, seeded = generate(one, GREEDY), generate(one, SEEDED)
    (full,) = one.collective_rpc(moe_shard_summary)
    one.shutdown()
    with LLM(qwen2_moe_dir, tensor_parallel_size=2, **ENGINE) as llm:  # warm-up on: one step through both ranks
        assert generate(llm, GREEDY) == greedy
        assert generate(llm, SEEDED) == seeded
        shards = llm.collective_rpc(moe_shard_summary)
    E, H, I = full["experts"]
    for rank, shard in enumerate(shards):
        assert shard == dict(rank=rank, experts=(E, H, I // 2), gate=full["gate"], shared=(full["shared"][0] // 2, H))
