"""The op-saving forms of RoPE and RMSNorm are bit-identical to the textbook (and HF) forms they replace."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RopeSpec, RopeTables, RotaryEmbedding, apply_rotary, rope_inv_freq, rotate


def textbook_rope(x, cos, sin):  # HF's apply_rotary_pos_emb for one tensor, sin not negated
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotate_is_bit_identical_to_rotate_half(dtype):
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 512, RopeSpec(theta=10000.0), torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 300, 511])
    x = torch.randn(5, 6, 64).to(dtype)  # (T, H, D)
    cos, signed_sin, _ = rope.lookup(positions, dtype)
    freqs = torch.outer(positions.float(), rope_inv_freq(64, RopeSpec(theta=10000.0)))  # (T, D/2)
    sin = torch.cat((freqs, freqs), -1).sin()[:, None].to(dtype)  # the textbook table
    assert torch.equal(signed_sin, torch.cat((-sin[..., :32], sin[..., 32:]), -1))  # first half negated
    assert torch.equal(rotate(x, RopeTables(cos, signed_sin)), textbook_rope(x, cos, sin))


def test_joint_qk_rotation_equals_separate():
    torch.manual_seed(1)
    rope = RotaryEmbedding(32, 64, RopeSpec(), torch.device("cpu"))
    cos_sin = rope.lookup(torch.arange(4), torch.float32)
    qk = torch.randn(4, 6, 32)  # 4 query heads then 2 key heads, as Attention.project rotates them
    q, k = apply_rotary(qk[:, :4], qk[:, 4:], cos_sin)
    joint = rotate(qk, cos_sin)
    assert torch.equal(joint[:, :4], q) and torch.equal(joint[:, 4:], k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rmsnorm_matches_hf_order_on_cpu(dtype):
    torch.manual_seed(2)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    norm = norm.to(dtype)
    x = (torch.randn(37, 576) * 3).to(dtype)
    hf = norm.weight * F.rms_norm(x.float(), (576,), eps=1e-5).to(dtype)  # normalise in fp32, cast, scale
    assert torch.equal(norm(x), hf)
