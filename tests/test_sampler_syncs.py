"""Sampling over Qwen's 151,936-token vocabulary with one device-to-host copy a step (the ids the engine reads):
nothing in a sampling call reads a tensor back to the host, and what is drawn is what the sort-based reference
keeps. On CPU a "read back" is counted by patching every Tensor method that would wait for a GPU; on a GPU
benchmarks/cuda_check.py runs both samplers under torch.cuda.set_sync_debug_mode("error")."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from minivllm.kernels.sampling import naive_cutoffs
from minivllm.layers.sampler import Sampler, SamplingRow, SamplingTensors

VOCAB = 151_936
READ_BACKS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
ROWS = [SamplingRow(0.0, 0, 1.0, 0.0, 1, 10),  # greedy
        SamplingRow(0.8, 50, 1.0, 0.0, 2, 11),  # top-k
        SamplingRow(1.0, 0, 0.9, 0.0, 3, 12),  # top-p
        SamplingRow(0.7, 20, 0.95, 0.05, 4, 13),  # all three
        SamplingRow(1.3, 0, 1.0, 0.1, 5, 14),  # min-p
        SamplingRow(1.0, 1, 1.0, 0.0, 6, 15)]  # top-k 1: the argmax, whatever the noise


@contextmanager
def counting_read_backs(monkeypatch):
    counts: Counter[str] = Counter()
    with monkeypatch.context() as m:
        for name in READ_BACKS:
            def counted(self, *args, _name=name, _original=getattr(torch.Tensor, name), **kwargs):
                counts[_name] += 1
                return _original(self, *args, **kwargs)

            m.setattr(torch.Tensor, name, counted)
        yield counts


def logits_for(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # (rows, V)


def test_the_counter_sees_a_read_back(monkeypatch):
    """The patching catches what the sampler used to do for top-k's width (`int(top_ks.max())`)."""
    with counting_read_backs(monkeypatch) as counts:
        int(torch.tensor([3, 7]).max())
        torch.tensor([1.0]).tolist()
    assert counts == {"__int__": 1, "tolist": 1}


def test_the_pytorch_sampler_reads_nothing_back_and_draws_what_the_reference_keeps(monkeypatch):
    logits = logits_for(len(ROWS))
    t = SamplingTensors.from_params(ROWS, VOCAB, torch.device("cpu"))  # the inputs: built before the call
    sampler = Sampler()
    with counting_read_backs(monkeypatch) as counts:
        ids = sampler(logits, t)  # (S,)
    assert counts == {}
    # The reference: keep each row's tokens at or above its sort-based cut-off, then the same Gumbel noise.
    temps = t.temperatures.clamp(min=1e-30)[:, None]
    scaled = torch.where(t.temperatures[:, None] > 0, logits / temps, logits)
    kept = scaled >= naive_cutoffs(logits, t.temperatures, t.top_ks, t.top_ps, t.min_ps)[:, None]
    noise = Sampler.gumbel_noise(t.seeds, t.positions, VOCAB, logits.device)
    drawn = torch.where(kept, scaled + noise, float("-inf")).argmax(-1)
    expected = torch.where(t.temperatures > 0, drawn, logits.argmax(-1))
    assert ids.tolist() == expected.tolist()
    assert ids[5] == logits[5].argmax()  # top-k 1


def test_a_row_draws_the_same_token_alone_and_batched():
    logits = logits_for(len(ROWS))
    batched = Sampler()(logits, SamplingTensors.from_params(ROWS, VOCAB, torch.device("cpu")))
    for i, row in enumerate(ROWS):
        alone = Sampler()(logits[i:i + 1], SamplingTensors.from_params([row], VOCAB, torch.device("cpu")))
        assert alone.item() == batched[i].item()


@pytest.mark.slow  # ~30 s in the interpreter: bisection passes over 151,936 logits a row
def test_the_triton_cutoffs_keep_what_the_pytorch_filter_keeps():
    """The kernel keeps what the PyTorch filter keeps when the filter is computed exactly (float64), but for a
    token whose fate the kernel's own rounding decides, per an error bound of its arithmetic (u = 2^-24):
      * in logits (top-k, min-p): it scales by x * (1 / T), two roundings, and min-p's max + log(min_p)
        adds two more: a token within 8u (|cut| + |max|) of the cut-off;
      * in mass (top-p): each exp(x - max) is off by its argument's rounding (u |x - max|) and a few ulps,
        and on its way into a sum a term meets at most V / BLOCK_V block sums in turn plus ~32 adds inside
        a block (numpy's pairwise sum, or a GPU's tree): a relative error of at most k u, k = that count,
        in the mass above a token and in the total it is compared with, so a token whose exact mass
        above it is within 2 k u of top_p (~1 token's mass here).
    Against the fp32 filter instead, a band of 4 ulps failed on an AVX2 CPU: ATen sums fp32 softmax and
    cumsum in lanes as wide as the CPU's vectors, which moved the mass by 3e-5 and kept 3 tokens fewer."""
    from minivllm.kernels.sampling import compute_cutoffs
    from minivllm.layers.sampler import apply_top_k_top_p_min_p

    rows = ROWS[1:5]
    logits = logits_for(len(rows))
    t = SamplingTensors.from_params(rows, VOCAB, torch.device("cpu"))
    cut = compute_cutoffs(logits, t.temperatures, t.top_ks.int(), t.top_ps, t.min_ps)[:, None]  # (S, 1)
    by_kernel = logits * (1 / t.temperatures[:, None]) >= cut  # (S, V): what pass 2 keeps, in its own arithmetic
    scaled = logits.double() / t.temperatures[:, None].double()  # (S, V) exact
    by_filter = apply_top_k_top_p_min_p(scaled, t) > float("-inf")
    u, top = 2.0 ** -24, scaled.max(-1, keepdim=True).values
    near_in_logits = (scaled - cut.double()).abs() <= 8 * u * (cut.double().abs() + top.abs())
    # top-p's mass is over what top-k leaves: the exact mass ranked above each token, as a share of that total
    after_k = apply_top_k_top_p_min_p(scaled, SamplingTensors.from_params(
        [r._replace(top_p=1.0, min_p=0.0) for r in rows], VOCAB, torch.device("cpu")))
    ordered, order = after_k.sort(dim=-1, descending=True)
    p = (ordered - top).exp()
    before = (p.cumsum(-1) - p) / p.sum(-1, keepdim=True)  # (S, V) in sorted order
    k = VOCAB / 4096 + 32 + (top - scaled.min(-1, keepdim=True).values) + 8  # (S, 1) roundings on a term's path
    near_in_mass = torch.zeros_like(by_filter).scatter_(1, order, (before - t.top_ps[:, None]).abs() <= 2 * k * u)
    near_in_mass &= (t.top_ps < 1)[:, None]
    differ = by_kernel ^ by_filter
    assert not (differ & ~near_in_logits & ~near_in_mass).any()
    assert (near_in_logits | near_in_mass).sum() <= 4 * len(rows)  # the bands are a few tokens wide, not a range
