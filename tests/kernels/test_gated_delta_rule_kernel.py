"""The recurrent gated-delta-rule kernel against its naive reference (Triton interpreter on CPU, fp32),
and the reference against the layer's PyTorch form (layers/gated_deltanet.py)."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.gated_delta_rule import fused_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule
from minivllm.layers.gated_deltanet import l2norm, recurrent_gated_delta_rule


def make_batch(lengths, slots, Hk=2, Hv=4, Dk=16, Dv=8, num_slots=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = l2norm(torch.randn(T, Hk, Dk, generator=gen))
    k = l2norm(torch.randn(T, Hk, Dk, generator=gen))
    v = torch.randn(T, Hv, Dv, generator=gen)
    g = -torch.rand(T, Hv, generator=gen) * 2
    beta = torch.rand(T, Hv, generator=gen)
    pool = torch.randn(num_slots, Hv, Dk, Dv, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, g, beta, pool, torch.tensor(slots, dtype=torch.int64), cu


def run_both(lengths, slots, block_v=32, **shape):
    q, k, v, g, beta, pool, slots_t, cu = make_batch(lengths, slots, **shape)
    pool_before = pool.clone()
    scale = q.shape[-1] ** -0.5
    out, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots_t, cu, scale, block_v=block_v)
    ref_out, ref_final = naive_recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots_t, cu, scale)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool, pool_before), "the kernel wrote into the state pool"


def test_decode_batch_with_fresh_and_continuing_requests():
    run_both([1, 1, 1, 1], slots=[3, -1, 0, 5])  # slot -1: the request starts from zeros


@pytest.mark.parametrize("lengths", [[3, 1, 2], [5]])
def test_several_rows_per_request(lengths):
    run_both(lengths, slots=list(range(len(lengths))))


@pytest.mark.parametrize("Hk,Hv", [(4, 4), (2, 4), (1, 4)])  # grouped value heads: 1, 2, 4 per q/k head
def test_value_head_groups(Hk, Hv):
    run_both([1, 2], slots=[1, 4], Hk=Hk, Hv=Hv)


@pytest.mark.parametrize("Dk,Dv,block_v", [(16, 24, 8), (12, 8, 32), (32, 32, 16)])  # tiles, padded Dk
def test_head_dims_and_value_tiles(Dk, Dv, block_v):
    run_both([1, 1, 2], slots=[2, -1, 0], Dk=Dk, Dv=Dv, block_v=block_v)


def test_stale_nan_in_a_fresh_requests_slot_is_not_read():
    q, k, v, g, beta, pool, _, cu = make_batch([1], [0])
    pool[0] = float("nan")  # a stale slot; slot -1 reads slot 0's address and must drop it
    out, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, torch.tensor([-1]), cu, 0.25)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()


def test_reference_matches_the_layer_form():
    lengths, slots = [1, 3, 1], [3, -1, 0]
    q, k, v, g, beta, pool, slots_t, cu = make_batch(lengths, slots)
    scale = q.shape[-1] ** -0.5
    ref_out, ref_final = naive_recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots_t, cu, scale)
    initial = torch.where((slots_t >= 0)[:, None, None, None], pool[slots_t.clamp(min=0)], 0.0)
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, initial, cu.tolist(), scale)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)
