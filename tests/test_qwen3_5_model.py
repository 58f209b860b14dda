"""The hybrid Qwen3.5 decoder (models/qwen3_5.py) against HF transformers' Qwen3_5ForCausalLM, fp32:
a prompt all at once, in chunks carrying state (paged KV for the full-attention layer), token by token,
and two requests sharing a varlen batch."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hybrid_helpers import Chunk, HybridHarness, load_from_hf, one_thread  # noqa: F401  (autouse fixture)
from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from minivllm.models.hf_config import load_model_spec, parse_model_spec
from minivllm.models.qwen3_5 import Qwen3_5ForCausalLM as MiniQwen3_5
from minivllm.models.qwen3_5 import text_weight_name
from minivllm.teaching.checkpoints import make_tiny_model

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
TOL = dict(atol=1e-3, rtol=1e-3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(checkpoint dir, HF model, our model with the same weights), 4 layers: 3 gated DeltaNet + 1 attention."""
    path = make_tiny_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", num_layers=4, layer_types=LAYER_TYPES)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    spec = load_model_spec(path)
    ours = MiniQwen3_5(spec)
    load_from_hf(ours, spec, hf.state_dict())
    ours.init_rotary(spec.max_position_embeddings, torch.device("cpu"))
    return path, hf, ours.eval()


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # (L, V)
    return hf(torch.tensor([ids])).logits[0]


def test_spec_from_the_tiny_checkpoint(models):
    spec = load_model_spec(models[0])
    assert spec.layer_types == tuple(LAYER_TYPES)
    assert spec.full_attention_layers == (3,) and spec.linear_attention_layers == (0, 1, 2)
    assert spec.attn_output_gate and spec.qk_norm and spec.q_proj_size == 2 * spec.q_size
    assert spec.rotary_dim == 4  # head_dim 16 x the default partial_rotary_factor 0.25
    la = spec.linear_attn
    assert (la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel_size) == (2, 4, 16, 8, 4)
    assert la.conv_state_shape == (2 * 2 * 16 + 4 * 8, 3) and la.recurrent_state_shape == (4, 16, 8)


@pytest.mark.parametrize("pieces", [[70], [5, 1, 30, 34], [64, 6]], ids=["all-at-once", "chunks", "64+6"])
def test_prefill_all_at_once_and_in_chunks_matches_hf(models, pieces):
    _, hf, ours = models
    ids = prompt(70)
    logits = HybridHarness(ours, ours.spec).run(ids, pieces)
    torch.testing.assert_close(logits, hf_logits(hf, ids), **TOL)


def test_token_by_token_decode_matches_hf(models):
    _, hf, ours = models
    ids = prompt(24, seed=1)
    logits = HybridHarness(ours, ours.spec).run(ids, [1] * 24)  # every step is a decode step
    torch.testing.assert_close(logits, hf_logits(hf, ids), **TOL)


def test_prefill_then_decode_matches_hf(models):
    _, hf, ours = models
    ids = prompt(30, seed=2)
    logits = HybridHarness(ours, ours.spec).run(ids, [13] + [1] * 17)
    torch.testing.assert_close(logits, hf_logits(hf, ids), **TOL)


def test_mixed_batch_equals_each_request_alone_and_never_writes_the_pools(models):
    """Request A: its first prefill chunk (a fresh request in a slot holding a stale NaN state).
    Request B: a decode after 12 committed tokens. Together in one varlen batch, or each alone."""
    _, hf, ours = models
    harness = HybridHarness(ours, ours.spec)
    a, b = prompt(9, seed=3), prompt(13, seed=4)
    harness.run(b, [12], slot=1)
    for pool in harness.conv_pools + harness.recurrent_pools:
        pool[2] = float("nan")  # what an earlier request left in A's slot must not be read
    pools_before = [p.clone() for p in harness.conv_pools + harness.recurrent_pools]
    chunk_a, chunk_b = Chunk(a, 0, 9, slot=2), Chunk(b, 12, 1, slot=1)
    both, both_states = harness.forward([chunk_a, chunk_b])
    alone_a, states_a = harness.forward([chunk_a])
    alone_b, states_b = harness.forward([chunk_b])
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), atol=1e-5, rtol=1e-5)
    for s, sa, sb in zip(both_states, states_a, states_b):
        torch.testing.assert_close(s.conv, torch.cat([sa.conv, sb.conv]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.recurrent, torch.cat([sa.recurrent, sb.recurrent]), atol=1e-5, rtol=1e-5)
    for pool, before in zip(harness.conv_pools + harness.recurrent_pools, pools_before):
        assert torch.equal(pool.nan_to_num(), before.nan_to_num()), "a forward wrote into a state pool"
    torch.testing.assert_close(alone_a, hf_logits(hf, a), **TOL)
    torch.testing.assert_close(alone_b, hf_logits(hf, b)[-1:], **TOL)


def test_conditional_generation_checkpoint_maps_to_the_text_model(models):
    """The published form: config nested under text_config, decoder weights under model.language_model."""
    path, hf, _ = models
    text = json.loads((path / "config.json").read_text())
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=4)
    cfg = Qwen3_5Config(text_config=Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "architectures"}),
                        vision_config=vision)
    cfg_dict = {**cfg.to_dict(), "architectures": ["Qwen3_5ForConditionalGeneration"]}
    spec = parse_model_spec(cfg_dict)
    assert spec.architecture == "Qwen3_5ForConditionalGeneration"
    assert spec.linear_attn == load_model_spec(path).linear_attn
    assert spec.layer_types == tuple(LAYER_TYPES) and spec.rotary_dim == 4

    from transformers import Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        names = Qwen3_5ForConditionalGeneration(cfg).state_dict().keys()
        text_names = Qwen3_5ForCausalLM(cfg.text_config).state_dict().keys()
    mapped = {text_weight_name(n) for n in list(names) + ["mtp.fc.weight"]} - {None}
    assert any(n.startswith("model.visual.") for n in names)
    assert mapped == set(text_names)


def test_bfloat16_prefill_and_decode_match_hf(models):
    """Half precision: the states stay float32 (recurrent) / bf16 (conv window, like HF's), and the
    decode conv sums its taps in float32 as conv1d does (a bf16 sum drifted 0.2 from HF in 40 steps)."""
    path, _, _ = models
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    spec = load_model_spec(path)
    ours = MiniQwen3_5(spec).to(torch.bfloat16)
    load_from_hf(ours, spec, hf.state_dict())
    ours.init_rotary(spec.max_position_embeddings, torch.device("cpu"))
    ids = prompt(40, seed=5)
    ref = hf_logits(hf, ids).float()
    for pieces in ([40], [10, 1, 29], [1] * 40):
        harness = HybridHarness(ours.eval(), spec)
        harness.kv_caches = [c.to(torch.bfloat16) for c in harness.kv_caches]
        harness.conv_pools = [c.to(torch.bfloat16) for c in harness.conv_pools]
        logits = harness.run(ids, pieces).float()
        assert (logits - ref).abs().max() < 0.05, pieces  # bf16's step near 2.0 is 0.016
