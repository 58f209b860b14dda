"""The C++ RoPE kernel (kernels/rotary_embedding.cpp): bit-identical to the torch form it replaces."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import require_cpu_kernels
from minivllm.kernels.rotary_embedding import naive_rotary_embedding, rotary_embedding
from minivllm.layers.rotary import RopeSpec, RotaryEmbedding, rotate

require_cpu_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,D", [(1, 8, 64), (33, 6, 128), (5, 3, 40), (4, 2, 6), (700, 4, 64)])
def test_bit_identical_to_naive_and_to_rotate(dtype, T, H, D):
    g = torch.Generator().manual_seed(T * H + D)
    rope = RotaryEmbedding(D, 2048, RopeSpec(theta=1e6), torch.device("cpu"))
    x = (torch.randn(T, H, D, generator=g) * 4).to(dtype)
    positions = torch.randint(0, 2048, (T,), generator=g)
    out = rotary_embedding(x, positions, rope.cos, rope.signed_sin)
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, naive_rotary_embedding(x, positions, rope.cos, rope.signed_sin))
    assert torch.equal(out, rotate(x, rope.lookup(positions, dtype)))  # the model's torch form
    assert torch.equal(out, rotate(x, rope.lookup(positions, dtype, kernel=True)))  # ... and its kernel form


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_of_the_fused_qkv_output(dtype):
    """q's and k's heads are views into qkv: rows (and, for a subset of heads, heads) strided."""
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(32, 64, RopeSpec(), torch.device("cpu"))
    qkv = torch.randn(7, 10, 32, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 63, 5, 5, 9])
    for view in (qkv[:, :8], qkv[:, 6:8], qkv[::2, 1:7:2]):
        p = positions[: view.shape[0]]
        assert torch.equal(rotary_embedding(view, p, rope.cos, rope.signed_sin),
                           naive_rotary_embedding(view, p, rope.cos, rope.signed_sin))


def test_bad_inputs_are_refused():
    rope = RotaryEmbedding(8, 16, RopeSpec(), torch.device("cpu"))
    x, p = torch.randn(2, 3, 8), torch.tensor([0, 15])
    with pytest.raises(RuntimeError, match="position 16 of row 1 is outside the tables"):
        rotary_embedding(x, torch.tensor([0, 16]), rope.cos, rope.signed_sin)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        rotary_embedding(x.half(), p, rope.cos, rope.signed_sin)
    with pytest.raises(RuntimeError, match="positions must be"):
        rotary_embedding(x, p.int(), rope.cos, rope.signed_sin)
    with pytest.raises(RuntimeError, match="tables"):
        rotary_embedding(x, p, rope.cos[:, :4].contiguous(), rope.signed_sin)
    with pytest.raises(RuntimeError, match="must be even"):
        rotary_embedding(torch.randn(2, 3, 7), p, torch.zeros(16, 7), torch.zeros(16, 7))
    with pytest.raises(RuntimeError, match="each head contiguous"):
        rotary_embedding(x.transpose(1, 2), p, rope.cos, rope.signed_sin)
