"""Tensor parallelism without processes: each rank's shard re-derived by hand from the checkpoint,
loading that reads only slices, and the refusals (which start no process)."""

from __future__ import annotations

import glob

import pytest
import torch
from safetensors.torch import load_file
from tp_helpers import child_pids

import minivllm.models.loader as loader
from minivllm import LLM
from minivllm.distributed.parallel_state import ParallelContext
from minivllm.engine.worker.loading import build_model
from minivllm.models.hf_config import LinearAttnSpec, load_model_spec, parse_model_spec
from minivllm.models.sharding import ShardLayout, check_shardable
from minivllm.teaching.checkpoints import make_tiny_model

SPEC_BASE = dict(architectures=["Qwen3ForCausalLM"], vocab_size=384, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def naive_shard(full: dict[str, torch.Tensor], spec, rank: int, n: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s parameters, cut from the full checkpoint one head / one row at a time."""
    D, Hq, Hkv = spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads
    q_heads = range(rank * Hq // n, (rank + 1) * Hq // n)
    kv_heads = range(rank * Hkv // n, (rank + 1) * Hkv // n) if Hkv >= n else [rank * Hkv // n]
    rows = lambda w, heads: torch.cat([w[h * D:(h + 1) * D] for h in heads])  # noqa: E731
    I, V = spec.intermediate_size // n, spec.vocab_size // n
    out = {"model.embed_tokens.weight": full["model.embed_tokens.weight"][rank * V:(rank + 1) * V],
           "model.norm.weight": full["model.norm.weight"]}
    if "lm_head.weight" in full:
        out["lm_head.weight"] = full["lm_head.weight"][rank * V:(rank + 1) * V]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for kind in ("weight", "bias"):
            if a + f"q_proj.{kind}" in full:
                out[a + f"qkv_proj.{kind}"] = torch.cat([rows(full[a + f"q_proj.{kind}"], q_heads),
                                                         rows(full[a + f"k_proj.{kind}"], kv_heads),
                                                         rows(full[a + f"v_proj.{kind}"], kv_heads)])
        out[a + "o_proj.weight"] = torch.cat([full[a + "o_proj.weight"][:, h * D:(h + 1) * D] for h in q_heads], 1)
        m = p + "mlp."
        out[m + "gate_up_proj.weight"] = torch.cat([full[m + "gate_proj.weight"][rank * I:(rank + 1) * I],
                                                    full[m + "up_proj.weight"][rank * I:(rank + 1) * I]])
        out[m + "down_proj.weight"] = full[m + "down_proj.weight"][:, rank * I:(rank + 1) * I]
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                     "self_attn.k_norm.weight"):
            if p + name in full:
                out[p + name] = full[p + name]
    return out


@pytest.mark.parametrize("variant", ["qwen3", "qwen2", "llama", "llama_mha_tied_llama3", "kv1"])
def test_each_rank_loads_exactly_its_slices(variant, model_factory, kv1_dir):
    path = kv1_dir if variant == "kv1" else model_factory(variant)
    spec = load_model_spec(path)
    full = {k: v for f in glob.glob(f"{path}/*.safetensors") for k, v in load_file(f).items()}
    for rank in range(2):
        model = build_model(spec, path, torch.device("cpu"), torch.float32, 64, ParallelContext(rank, 2))
        got = dict(model.named_parameters())
        want = naive_shard(full, spec, rank, 2)
        assert set(got) == set(want)
        for name, w in want.items():
            assert torch.equal(got[name], w), name


def test_loading_reads_only_the_slices(qwen3_dir, monkeypatch):
    """Sharded tensors go through get_slice (a view of the memory map), never get_tensor; a rank
    reads half of every sharded tensor."""
    read: dict[str, int] = {}
    real_open = loader.safe_open

    class Spy:
        def __init__(self, path, framework):
            self.f = real_open(path, framework=framework)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            t = self.f.get_tensor(name)
            read[name] = read.get(name, 0) + t.numel()
            return t

        def get_slice(self, name):
            f = self.f

            class Slice:
                def __getitem__(self, index):
                    t = f.get_slice(name)[index]
                    read[name] = read.get(name, 0) + t.numel()
                    return t
            return Slice()

    monkeypatch.setattr(loader, "safe_open", Spy)
    spec = load_model_spec(qwen3_dir)
    full = {k: v for f in glob.glob(f"{qwen3_dir}/*.safetensors") for k, v in load_file(f).items()}
    build_model(spec, qwen3_dir, torch.device("cpu"), torch.float32, 64, ParallelContext(1, 2))
    layout = ShardLayout.of(spec, 1, 2)
    for name, t in full.items():
        sharded = layout.checkpoint_slice(name) is not None
        assert read[name] == (t.numel() // 2 if sharded else t.numel()), name
        if t.dim() == 2:  # every matrix is sharded; only norms (vectors) are read whole
            assert sharded, name
    assert sum(read.values()) < 0.55 * sum(t.numel() for t in full.values())


def test_refusals_say_what_does_not_divide():
    nine_heads = parse_model_spec({**SPEC_BASE, "num_attention_heads": 9, "num_key_value_heads": 3,
                                   "intermediate_size": 192})  # as SmolLM2-135M: 9 heads, 3 KV heads
    with pytest.raises(ValueError, match=r"does not divide the model's 9 attention heads.*one of \[1, 3\]"):
        check_shardable(nine_heads, 2)
    kv3 = parse_model_spec({**SPEC_BASE, "num_attention_heads": 12, "num_key_value_heads": 3, "intermediate_size": 192})
    with pytest.raises(ValueError, match="neither divides the model's 3 KV heads"):
        check_shardable(kv3, 2)
    check_shardable(kv3, 3)  # 1 KV head per rank
    check_shardable(parse_model_spec({**SPEC_BASE, "num_key_value_heads": 1}), 4)  # replicated 4 times
    with pytest.raises(ValueError, match="vocabulary"):
        check_shardable(parse_model_spec({**SPEC_BASE, "vocab_size": 385}), 2)
    from dataclasses import replace
    hybrid = replace(parse_model_spec(SPEC_BASE), linear_attn=LinearAttnSpec(2, 4, 16, 8, 4))
    with pytest.raises(ValueError, match="hybrid model"):
        check_shardable(hybrid, 2)
    check_shardable(hybrid, 1)


def test_a_refused_model_starts_no_process(tmp_path):
    path = make_tiny_model(tmp_path / "nine", family="qwen3", num_heads=9, num_kv_heads=3, num_layers=1)
    before = child_pids()
    with pytest.raises(ValueError, match="9 attention heads"):
        LLM(str(path), tensor_parallel_size=2)
    assert child_pids() == before
