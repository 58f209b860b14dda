"""The verification kernel against its reference, and the reference against the target distribution."""

from __future__ import annotations

import pytest
import torch

from minivllm.engine.spec_decode.rejection_sampler import naive_rejection_sample
from minivllm.kernels.rejection_sampling import triton_rejection_sample


def case(G: int, K: int, V: int, with_q: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(G, K, V, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(G, K, V, generator=gen) * 2, -1) if with_q else None
    drafts = torch.randint(0, V, (G, K), generator=gen)
    if with_q:  # draws from q, as a draft model would
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(G, K)
    # some drafts are the target's argmax, so that runs of acceptances happen
    drafts[:, ::2] = p[:, ::2].argmax(-1)
    nd = torch.randint(0, K + 1, (G,), generator=gen)
    u = torch.rand(G, K, generator=gen)
    gum = -torch.log(torch.empty(G, K, V).exponential_(generator=gen))
    bonus = torch.randint(0, V, (G,), generator=gen)
    return p, q, drafts, nd, u, gum, bonus


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("G, K, V", [(1, 1, 16), (4, 3, 40), (3, 5, 130)])
def test_kernel_matches_reference(G, K, V, with_q):
    for seed in range(3):
        args = case(G, K, V, with_q, seed)
        t_ref, a_ref = naive_rejection_sample(*args)
        t, a = triton_rejection_sample(*args)
        assert torch.equal(t, t_ref) and torch.equal(a, a_ref)


@pytest.mark.parametrize("with_q", [False, True])
def test_first_token_keeps_the_target_distribution(with_q):
    """Whatever the proposal, the first emitted token is distributed as p (one draft, many trials)."""
    V, n = 6, 20000
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = torch.tensor([0.05, 0.05, 0.6, 0.1, 0.1, 0.1])
    drafts = (torch.multinomial(q, n, replacement=True, generator=gen) if with_q
              else torch.full((n,), 2))  # a deterministic proposer always guesses token 2
    P = p.expand(n, 1, V).contiguous()
    Q = q.expand(n, 1, V).contiguous() if with_q else None
    u = torch.rand(n, 1, generator=gen)
    gum = -torch.log(torch.empty(n, 1, V).exponential_(generator=gen))
    bonus = torch.zeros(n, dtype=torch.int64)
    tokens, _ = naive_rejection_sample(P, Q, drafts[:, None], torch.ones(n, dtype=torch.int64), u, gum, bonus)
    freq = torch.bincount(tokens[:, 0], minlength=V).float() / n
    assert torch.allclose(freq, p, atol=0.015), freq
