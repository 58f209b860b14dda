"""The sampling kernels: cut-offs against a sort-based reference, the draw statistically, seeds."""

from __future__ import annotations

import pytest
import torch
from helpers import expected_distribution
from minivllm.kernels.sampling import compute_cutoffs, gumbel_argmax, naive_cutoffs, triton_sample


def params(rows):
    t, k, p, m = zip(*rows)
    return (torch.tensor(t, dtype=torch.float32), torch.tensor(k, dtype=torch.int32),
            torch.tensor(p, dtype=torch.float32), torch.tensor(m, dtype=torch.float32))


def test_cutoffs_keep_exactly_what_the_sort_based_reference_keeps():
    g = torch.Generator().manual_seed(0)
    rows = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 10, 0.9, 0.1), (1.0, 3, 0.5, 0.0),
            (0.5, 0, 0.95, 0.05), (1.0, 1, 1.0, 0.0), (2.0, 60, 0.3, 0.0)]
    logits = torch.randn(len(rows), 300, generator=g) * 3
    cut = compute_cutoffs(logits, *params(rows))
    ref = naive_cutoffs(logits, *params(rows))
    temps = params(rows)[0][:, None]
    assert torch.equal(logits / temps >= cut[:, None], logits / temps >= ref[:, None])


@pytest.mark.slow  # ~10 s each in the interpreter: one program per draw
@pytest.mark.parametrize("row", [(1.0, 0, 1.0, 0.0), (0.8, 5, 0.9, 0.05)])
def test_draws_follow_the_filtered_distribution(row):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8])
    n = 1500  # the interpreter runs one program per draw: keep this modest
    cutoff = compute_cutoffs(logits[None], *params([row]))  # pass 1 once: every row is the same
    t = params([row] * n)[0]
    tokens = gumbel_argmax(logits.expand(n, -1).contiguous(), t, cutoff.expand(n).contiguous(), [7] * n,
                           list(range(n)))
    freq = torch.bincount(tokens, minlength=8).float() / n
    expected = expected_distribution(logits, *row)
    assert torch.all(freq[expected == 0] == 0), "a filtered token was drawn"
    assert torch.allclose(freq, expected, atol=0.045), (freq, expected)  # ~4 sigma at n=1500


def test_seeded_rows_do_not_depend_on_their_companions_and_greedy_is_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 64, generator=g)
    rows = [(0.9, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.2, 8, 0.9, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 0.8, 0.0)]
    all_rows = triton_sample(logits, *params(rows), seeds=[11, 12, 13, 14, 15], positions=[3, 4, 5, 6, 7])
    alone = triton_sample(logits[2:3], *params(rows[2:3]), seeds=[13], positions=[5])
    assert all_rows[2] == alone[0]
    assert all_rows[1] == logits[1].argmax()
    again = triton_sample(logits, *params(rows), seeds=[11, 12, 13, 14, 15], positions=[3, 4, 5, 6, 7])
    assert torch.equal(all_rows, again)
    other_pos = triton_sample(logits[3:4].expand(40, -1).contiguous(), *params(rows[3:4] * 40), seeds=[14] * 40,
                              positions=list(range(40)))
    assert other_pos.unique().numel() > 3  # the position keys the noise: draws vary along a request
