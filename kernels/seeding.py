"""`noise_seed`: one 64-bit random-stream seed per (request seed, token position).

Both samplers draw a row's Gumbel noise from a stream keyed by this number: the PyTorch sampler
seeds a `torch.Generator` with it, the Triton sampler (`sampling.py`) feeds it to Philox. Keying by
position (not by "the next draw") is what makes a seeded request reproducible whatever shares its
batch, and makes a recomputed (preempted) request redraw the same tokens.

Plain Python, no torch and no triton: the PyTorch sampler and the engine import it at start-up,
and importing triton there would fix TRITON_INTERPRET before the user had a chance to set it.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """Mix (seed, position) into one 64-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
