"""Notebook 18's helpers (minivllm/teaching/tiny_moe.py, moe_viz.py): the tiny MoE checkpoint, the routes caught
from a running engine, the byte counts and the timing, and the pictures at the site's width."""

from __future__ import annotations

import pytest
import torch

from minivllm.layers.fused_moe import FusedMoE
from minivllm.layers.moe_router import select_experts
from minivllm.models.hf_config import load_model_spec
from minivllm.teaching import moe_viz
from minivllm.teaching.tiny_moe import make_tiny_moe_model, qwen3_30b_a3b_spec


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("moe"), num_experts=6, top_k=3)


def test_the_tiny_checkpoint_is_what_was_asked_for(tiny_moe, tmp_path):
    spec = load_model_spec(tiny_moe)
    assert spec.architecture == "Qwen3MoeForCausalLM" and spec.qk_norm
    assert (spec.moe.num_experts, spec.moe.num_experts_per_tok, spec.moe.norm_topk_prob) == (6, 3, True)
    qwen2 = load_model_spec(make_tiny_moe_model(tmp_path / "q2", "qwen2_moe", num_layers=1, norm_topk_prob=False))
    assert qwen2.architecture == "Qwen2MoeForCausalLM" and qwen2.moe.shared_expert_intermediate_size == 48
    assert not qwen2.moe.norm_topk_prob
    with pytest.raises(ValueError, match="family='mixtral'"):
        make_tiny_moe_model(tmp_path / "x", "mixtral")
    with pytest.raises(ValueError, match="top_k=9"):
        make_tiny_moe_model(tmp_path / "y", num_experts=8, top_k=9)


def test_capture_routing_sees_every_prompt_token_of_every_sparse_layer(tiny_moe):
    from minivllm import LLM

    llm = LLM(str(tiny_moe), dtype="float32", num_kv_blocks=32, block_size=4)
    try:
        prompt = list(range(10, 31))  # 21 tokens: five full blocks of 4 go into the prefix cache
        captures = moe_viz.capture_routing(llm, prompt)
        experts = llm.llm_engine.model.expert_layers()
        assert len(captures) == len(experts) == 2
        for layer, block, capture in zip(experts, llm.llm_engine.model.model.layers, captures):
            assert capture.hidden.shape == (21, 64) and capture.router_logits.shape == (21, 6)
            assert torch.allclose(block.mlp.gate(capture.hidden), capture.router_logits)
            ids = select_experts(capture.router_logits, 3, True).topk_ids
            assert torch.equal(torch.bincount(ids.flatten(), minlength=6), layer.last_load)
        with pytest.raises(ValueError, match="prefix cache"):
            moe_viz.capture_routing(llm, prompt)  # the same prompt again: 20 of its tokens are cached
    finally:
        llm.shutdown()


def test_decode_bytes_counts_qwen3_30b_a3b_as_published():
    """Qwen3-30B-A3B's model card: 30.5 B weights, 29.9 B of them not embeddings (nor the LM head), 3.3 B
    activated. decode_bytes leaves the embedding table out (a token reads one row of it)."""
    spec = qwen3_30b_a3b_spec()
    counted = moe_viz.decode_bytes(spec, bytes_per_weight=1)
    embedding = spec.vocab_size * spec.hidden_size
    assert (counted.sparse_layers, counted.num_experts, counted.top_k) == (48, 128, 8)
    assert counted.expert == 3 * 2048 * 768
    assert round((counted.dense + embedding) / 1e9, 1) == 30.5
    assert round((counted.dense - spec.vocab_size * spec.hidden_size) / 1e9, 1) == 29.9  # less the LM head
    assert 3.3e9 <= counted.moe_token + embedding < 3.4e9
    assert moe_viz.decode_bytes(spec, bytes_per_weight=2).moe_token == 2 * counted.moe_token
    assert counted.moe_step(counted.num_experts) == counted.dense


def test_decode_bytes_refuses_a_dense_model(tmp_path):
    from minivllm.teaching.checkpoints import make_tiny_model

    with pytest.raises(ValueError, match="no experts"):
        moe_viz.decode_bytes(load_model_spec(make_tiny_model(tmp_path, num_layers=1)), 2)


def test_expected_active_experts():
    assert moe_viz.expected_active_experts(128, 8, 1) == pytest.approx(8)
    assert moe_viz.expected_active_experts(128, 8, 0) == 0
    assert moe_viz.expected_active_experts(8, 8, 3) == 8  # every token takes every expert
    assert moe_viz.expected_active_experts(128, 8, 32) == pytest.approx(128 * (1 - (15 / 16) ** 32))
    # against routing by hand: each of 400 tokens draws 2 distinct experts of 16, uniformly
    gen = torch.Generator().manual_seed(0)
    touched = [len(set(torch.rand(5, 16, generator=gen).topk(2).indices.flatten().tolist())) for _ in range(400)]
    assert sum(touched) / len(touched) == pytest.approx(moe_viz.expected_active_experts(16, 2, 5), rel=0.05)


def test_time_moe_decode_counts_the_active_experts_bytes():
    moe = FusedMoE(8, 2, 32, 16, renormalize=True)
    dense = FusedMoE(1, 1, 32, 8 * 16, renormalize=True)
    for layer in (moe, dense):
        for w in (layer.w13_weight, layer.w2_weight):
            w.data = torch.randn(w.shape) * 0.1
    expert = moe.w13_weight[0].nbytes + moe.w2_weight[0].nbytes
    one = moe_viz.time_moe_decode(moe, batch=1, repeats=3, evict_bytes=1 << 16)
    assert one.seconds > 0 and one.bytes_read == 2 * expert  # one token: its k experts, distinct
    assert moe_viz.time_moe_decode(dense, batch=1, repeats=3, evict_bytes=0).bytes_read == 8 * expert
    many = moe_viz.time_moe_decode(moe, batch=16, repeats=3, evict_bytes=0)
    assert 2 * expert < many.bytes_read <= 8 * expert


def test_the_pictures_are_readable_at_the_site_width():
    """The conventions of tests/test_docs_site.py for teaching.viz: 8 inches wide, no text under 8 pt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from minivllm.kernels.moe_align import moe_align_block_size
    from minivllm.teaching.viz import WIDTH

    topk_ids = torch.tensor([[2, 0], [1, 2], [0, 2]])
    alignment = moe_align_block_size(topk_ids, block_size=2, num_experts=4)
    drawings = {
        "route": lambda: moe_viz.plot_token_route(torch.softmax(torch.randn(8), 0), torch.tensor([3, 1]),
                                                  torch.tensor([0.6, 0.4])),
        "load": lambda: moe_viz.plot_expert_load([torch.tensor([3, 0, 2, 1]), torch.tensor([1, 1, 2, 2])], 2),
        "sorted": lambda: moe_viz.plot_sorted_routes(alignment, top_k=2),
        "bytes": lambda: moe_viz.plot_bytes_per_step(moe_viz.decode_bytes(qwen3_30b_a3b_spec(), 2), [1, 8, 64]),
    }
    for name, draw in drawings.items():
        ax = draw()
        fig = ax.figure
        fig.canvas.draw()
        assert abs(fig.get_figwidth() - WIDTH) < 1e-6, name
        texts = [t.get_text() for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]
        sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]
        assert min(sizes) >= 8, f"{name}: text of {min(sizes)} pt"
        if name == "sorted":  # 6 routes in 4 blocks of 2: experts 0, 1, 2, 2; two padding rows
            assert texts.count("pad") == 2 and "block 3: expert 2" in texts
        plt.close(fig)
