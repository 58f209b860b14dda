"""Rotary position embeddings (RoPE), "rotate-half" (GPT-NeoX) layout as in HF Llama/Qwen.

For a head vector x split into halves (x1, x2) and per-pair frequency f_i, position p rotates
    x' = x * cos(p f) + rotate_half(x) * sin(p f),   rotate_half(x) = (-x2, x1)
The cos/sin table for every position up to `max_position` is built once, in float32.

Frequencies: f_i = theta^(-2i/d). Scaled variants:
  * "linear": every f_i / factor.
  * "llama3": long wavelengths (> original_len / low_freq_factor) are divided by `factor`, short
    ones (< original_len / high_freq_factor) are kept, and the band between is interpolated
    smoothly between the two (Llama 3.1's recipe for extending the context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeSpec:
    """A checkpoint's RoPE settings (read from config.json by `models/hf_config.py`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(head_dim: int, rope: RopeSpec) -> torch.Tensor:  # (head_dim // 2,)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(in_band, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """Holds the (max_position, head_dim) cos and sin tables. A step looks up its positions once
    (`lookup`) and every layer applies the result (`apply_rotary`)."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeSpec, device: torch.device) -> None:
        inv_freq = rope_inv_freq(head_dim, rope).to(device)
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (max_position, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_position, head_dim)
        self.cos, self.sin = emb.cos(), emb.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (T,) -> cos, sin (T, 1, D), broadcast over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin  # q (T, Hq, D), k (T, Hkv, D)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
