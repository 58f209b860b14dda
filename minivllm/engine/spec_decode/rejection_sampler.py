"""Verifying drafts: accept what the target agrees with, and keep the target's distribution exactly.

For one sequence with drafts x_1..x_d, the target's probabilities p_j at each draft position, and
the proposer's q_j (one-hot for a deterministic proposer):

    for j in 1..d:
        if u_j < p_j(x_j) / q_j(x_j):   accept x_j                       (u_j ~ U(0, 1))
        else:                           emit a draw from norm(max(0, p_j - q_j)); stop
    all accepted:                       emit the target's own draw at position d+1 (the bonus)

Every emitted token is then distributed exactly as the target alone would have drawn it
(Leviathan et al. 2023; Chen et al. 2023). Greedy rows are the special case p_j = one-hot(argmax):
a draft is accepted iff it is the target's argmax, and a rejection emits the argmax — the longest
agreeing prefix plus one token of the target's. So greedy output is identical with speculation.

The noise is keyed by (request seed, position) like the sampler's (u_j from its own stream), so
verification does not depend on what else is in the batch.

Tensors are padded per sequence to K = num_speculative_tokens:
    target_probs (G, K, V)  draft_probs (G, K, V) or None  draft_ids (G, K)  num_drafts (G,)
    uniform (G, K)          gumbel (G, K, V)               bonus_ids (G,)
"""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.engine.worker.sampling_metadata import SamplingBatch
from minivllm.kernels.seeding import noise_seed
from minivllm.layers.sampler import SamplingTensors, filtered_probs

_UNIFORM_STREAM = 0x2545F4914F6CDD1D  # keeps the acceptance noise apart from the Gumbel noise


def naive_rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_ids: torch.Tensor,
                           num_drafts: torch.Tensor, uniform: torch.Tensor, gumbel: torch.Tensor,
                           bonus_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: returns (tokens (G, K+1) padded with -1, num_accepted (G,))."""
    G, K, _ = target_probs.shape
    tokens = torch.full((G, K + 1), -1, dtype=torch.int64)
    accepted = torch.zeros(G, dtype=torch.int64)
    for g in range(G):
        d = int(num_drafts[g])
        for j in range(d + 1):
            if j == d:  # every draft accepted: the target's own next token
                tokens[g, j] = bonus_ids[g]
                break
            x = int(draft_ids[g, j])
            p = target_probs[g, j]
            q = draft_probs[g, j] if draft_probs is not None else torch.nn.functional.one_hot(
                draft_ids[g, j], p.numel()).to(p.dtype)
            if float(uniform[g, j]) * float(q[x]) < float(p[x]):  # u < p/q, without dividing by 0
                tokens[g, j] = x
                accepted[g] += 1
                continue
            residual = (p - q).clamp(min=0)  # (V,)
            if float(residual.sum()) <= 0:  # p == q: any draw from p is right
                residual = p
            tokens[g, j] = int((residual.log() + gumbel[g, j]).argmax())
            break
    return tokens, accepted


def verification_noise(seeds: list[int], positions: list[int], vocab_size: int, k: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """uniform (G, K) and gumbel (G, K, V), keyed by (seed, position of draft j)."""
    G = len(seeds)
    uniform = torch.empty(G, k, device=device)
    expo = torch.empty(G, k, vocab_size, device=device)
    gen = torch.Generator(device=device)
    for g, (seed, pos) in enumerate(zip(seeds, positions)):
        for j in range(k):
            gen.manual_seed(noise_seed(seed ^ _UNIFORM_STREAM, pos + j))
            uniform[g, j : j + 1].uniform_(generator=gen)
            gen.manual_seed(noise_seed(seed, pos + j))
            expo[g, j].exponential_(generator=gen)
    return uniform, -expo.log()


class Verifier(Protocol):
    def __call__(self, *args: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


def verify_drafts(sb: SamplingBatch, logits: torch.Tensor, t: SamplingTensors, tokens: list[int],
                  verifier: Verifier) -> list[int | None]:
    """The token each sampled row emits. Ordinary rows: their own draw (`tokens`). The 1 + d rows of
    a draft group: the accepted drafts, then the target's correction or bonus token; None for rows
    past the first rejection. `logits`: (S, V) processed logits of every sampled row."""
    emitted: list[int | None] = list(tokens)
    groups = sb.spec_groups
    if not groups:
        return emitted
    G, K, V = len(groups), max(len(g.draft_token_ids) for g in groups), logits.shape[1]
    dev = logits.device
    draft_rows = [g.first + j for g in groups for j in range(len(g.draft_token_ids))]
    p = torch.zeros(G, K, V, device=dev)
    if draft_rows:
        probs = filtered_probs(logits[draft_rows], t.select(draft_rows))  # (R, V)
        at = 0
        for i, g in enumerate(groups):
            d = len(g.draft_token_ids)
            p[i, :d] = probs[at:at + d]
            at += d
    draft_ids = torch.zeros(G, K, dtype=torch.int64, device=dev)
    q = torch.zeros(G, K, V, device=dev) if any(g.draft_probs is not None for g in groups) else None
    for i, g in enumerate(groups):
        d = len(g.draft_token_ids)
        draft_ids[i, :d] = torch.tensor(g.draft_token_ids, dtype=torch.int64)
        if q is not None and d:
            q[i, :d] = g.draft_probs if g.draft_probs is not None else torch.nn.functional.one_hot(
                draft_ids[i, :d], V).float()
    num_drafts = torch.tensor([len(g.draft_token_ids) for g in groups], device=dev)
    bonus = torch.tensor([tokens[g.first + len(g.draft_token_ids)] for g in groups], device=dev)
    uniform, gumbel = torch.zeros(G, K, device=dev), torch.zeros(G, K, V, device=dev)
    for i, g in enumerate(groups):  # greedy groups need no noise: p is one-hot
        if float(t.temperatures[g.first]) > 0 and g.draft_token_ids:
            u, gum = verification_noise([t.seeds[g.first]], [t.positions[g.first]], V, K, dev)
            uniform[i], gumbel[i] = u[0], gum[0]
    out, accepted = verifier(p, q, draft_ids, num_drafts, uniform, gumbel, bonus)
    out_l, acc_l = out.tolist(), accepted.tolist()
    for i, g in enumerate(groups):
        for j in range(len(g.draft_token_ids) + 1):
            emitted[g.first + j] = out_l[i][j] if j <= acc_l[i] else None
    return emitted


class RejectionSampler:
    """The PyTorch verifier (the reference above)."""

    def __call__(self, *args: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return naive_rejection_sample(*args)


class TritonRejectionSampler:
    """The same contract through kernels/rejection_sampling.py."""

    def __call__(self, *args: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        from minivllm.kernels.rejection_sampling import triton_rejection_sample

        return triton_rejection_sample(*args)
