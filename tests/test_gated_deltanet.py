"""The gated delta rule and the short causal conv (layers/gated_deltanet.py) against HF transformers'
PyTorch references, and the property chunked prefill relies on: carrying the state across any cut of a
sequence gives what one pass gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hybrid_helpers import one_thread  # noqa: F401  (autouse fixture)
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn as hf_causal_conv1d
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as hf_chunk_rule
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as hf_recurrent_rule

from minivllm.layers.gated_deltanet import (causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule, l2norm,
                                            recurrent_gated_delta_rule)

TOL = dict(atol=2e-5, rtol=2e-5)


def make_inputs(lengths: list[int], Hk: int = 2, Hv: int = 4, Dk: int = 16, Dv: int = 8, seed: int = 0):
    """Random q, k (unit), v, decays g <= 0 (some strong), betas in (0, 1), and a random starting state
    per request, for requests of the given lengths packed back to back."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = l2norm(torch.randn(T, Hk, Dk, generator=gen))
    k = l2norm(torch.randn(T, Hk, Dk, generator=gen))
    v = torch.randn(T, Hv, Dv, generator=gen)
    g = -F.softplus(torch.randn(T, Hv, generator=gen)) * 3  # exp(g) from ~1 down to ~1e-4
    beta = torch.rand(T, Hv, generator=gen)
    state = torch.randn(len(lengths), Hv, Dk, Dv, generator=gen)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, g, beta, state, cu


def hf_rule(fn, q, k, v, g, beta, state):  # one request, HF's (batch, time, heads, dim) layout
    out, final = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
                    output_final_state=True, use_qk_l2norm_in_kernel=False)
    return out[0], final[0]


@pytest.mark.parametrize("length", [1, 5, 64, 65, 150])  # inside, on and across 64-token chunks
@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_rules_match_hf_references(rule, length):
    q, k, v, g, beta, state, cu = make_inputs([length])
    out, final = rule(q, k, v, g, beta, state, cu)
    for hf_fn in (hf_recurrent_rule, hf_chunk_rule):
        ref_out, ref_final = hf_rule(hf_fn, q, k, v, g, beta, state[0])
        torch.testing.assert_close(out, ref_out, **TOL)
        torch.testing.assert_close(final[0], ref_final, **TOL)


@pytest.mark.parametrize("pieces", [[1] * 20 + [80], [3, 1, 17, 9, 1, 69], [40, 40, 20], [100]])
@pytest.mark.parametrize("chunk_size", [4, 64])
def test_state_carried_across_cuts_equals_one_pass(pieces, chunk_size):
    """Chunked prefill: a 100-token sequence cut into pieces, each continuing from the last one's state."""
    assert sum(pieces) == 100
    q, k, v, g, beta, state, cu = make_inputs([100], seed=1)
    whole_out, whole_final = recurrent_gated_delta_rule(q, k, v, g, beta, state, cu)
    outs, carried, start = [], state, 0
    for n in pieces:
        rows = slice(start, start + n)
        out, carried = chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], carried, [0, n],
                                              chunk_size=chunk_size)
        outs.append(out)
        start += n
    torch.testing.assert_close(torch.cat(outs), whole_out, **TOL)
    torch.testing.assert_close(carried, whole_final, **TOL)


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_varlen_batch_equals_each_request_alone(rule):
    lengths = [7, 1, 70, 3]
    q, k, v, g, beta, state, cu = make_inputs(lengths, seed=2)
    out, final = rule(q, k, v, g, beta, state, cu)
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        alone_out, alone_final = rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state[i:i + 1], [0, e - s])
        torch.testing.assert_close(out[s:e], alone_out, **TOL)
        torch.testing.assert_close(final[i], alone_final[0], **TOL)


def test_decode_batch_is_one_vectorised_step_and_matches_chunked():
    q, k, v, g, beta, state, cu = make_inputs([1, 1, 1, 1, 1], seed=3)
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state, cu)
    ref_out, ref_final = chunk_gated_delta_rule(q, k, v, g, beta, state, cu)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_rules_never_write_their_inputs(rule):
    inputs = make_inputs([5, 1], seed=4)
    before = [x.clone() for x in inputs[:-1]]
    _, final = rule(*inputs)
    for x, x0 in zip(inputs[:-1], before):
        assert torch.equal(x, x0)
    assert final.data_ptr() != inputs[5].data_ptr()


def conv_inputs(lengths: list[int], C: int = 12, K: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return x, weight, cu


def test_causal_conv_from_zeros_matches_hf():
    x, weight, cu = conv_inputs([9])
    out, window = causal_conv1d(x, weight, torch.zeros(1, 12, 3), cu)
    ref = hf_causal_conv1d(x.t()[None], weight, None, activation="silu")[0].t()  # (T, C)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(window[0], x[-3:].t())  # the last K-1 inputs


@pytest.mark.parametrize("pieces", [[1] * 9, [2, 1, 6], [1, 8], [9]])  # pieces shorter than K-1 too
def test_causal_conv_window_carried_across_cuts(pieces):
    x, weight, cu = conv_inputs([9], seed=1)
    start_window = torch.randn(1, 12, 3)
    whole, whole_window = causal_conv1d(x, weight, start_window, cu)
    outs, window, start = [], start_window, 0
    for n in pieces:
        if n == 1:  # a decode step takes the vectorised path
            out, window = causal_conv1d_update(x[start:start + 1], weight, window)
        else:
            out, window = causal_conv1d(x[start:start + n], weight, window, [0, n])
        outs.append(out)
        start += n
    torch.testing.assert_close(torch.cat(outs), whole, **TOL)
    torch.testing.assert_close(window, whole_window)


def test_causal_conv_varlen_batch_equals_each_alone_and_keeps_its_inputs():
    x, weight, cu = conv_inputs([5, 1, 2], seed=2)
    windows = torch.randn(3, 12, 3)
    before = windows.clone()
    out, new_windows = causal_conv1d(x, weight, windows, cu)
    assert torch.equal(windows, before)
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        alone, alone_window = causal_conv1d(x[s:e], weight, windows[i:i + 1], [0, e - s])
        torch.testing.assert_close(out[s:e], alone)
        torch.testing.assert_close(new_windows[i], alone_window[0])
    # a request of 1 row keeps 2 inputs of its old window: [old[1], old[2], x]
    torch.testing.assert_close(new_windows[1], torch.cat([windows[1, :, 1:], x[5:6].t()], dim=-1))


def test_the_chunked_rule_and_the_conv_hand_back_the_states_at_given_offsets():
    """Prefix caching's snapshots: the state after o rows of a request is what a pass over those o rows
    alone ends with; the chunk cuts follow each request's own positions (`starts`), outputs unchanged."""
    lengths, starts, offsets = [150, 40], [0, 37], [[5, 64, 128, 150], [27, 40]]
    q, k, v, g, beta, state, cu = make_inputs(lengths, seed=3)
    snaps: list[torch.Tensor] = []
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, cu, starts=starts, snapshot_offsets=offsets,
                                        snapshots=snaps)
    plain, plain_final = chunk_gated_delta_rule(q, k, v, g, beta, state, cu)
    torch.testing.assert_close(out, plain, **TOL)
    torch.testing.assert_close(final, plain_final, **TOL)
    expected = []
    for i, s in enumerate(cu[:-1]):
        for o in offsets[i]:
            rows = slice(s, s + o)
            expected.append(recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                       state[i:i + 1], [0, o])[1][0])
    assert len(snaps) == len(expected)
    for got, want in zip(snaps, expected):
        torch.testing.assert_close(got, want, **TOL)
    x, weight, cu = conv_inputs([9, 4], seed=4)
    windows, conv_snaps = torch.randn(2, 12, 3), []
    causal_conv1d(x, weight, windows, cu, [[1, 2, 9], [4]], conv_snaps)
    for got, (i, o) in zip(conv_snaps, [(0, 1), (0, 2), (0, 9), (1, 4)]):
        rows = slice(cu[i], cu[i] + o)
        torch.testing.assert_close(got, causal_conv1d(x[rows], weight, windows[i:i + 1], [0, o])[1][0])
